"""OpenAI request planning and response formatting, pure (no server): real pydantic parsing, the real
synthetic word-level tokenizer with its chat template, and the real prometheus registry."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from dwdp_worker.front.openai import chat
from dwdp_worker.front.openai.format import FinishReason, PromptOutcome, TextStream, completion_response, sse
from dwdp_worker.front.openai.requests import OpenAIRequestError, plan_chat, plan_completion
from dwdp_worker.front.openai.schemas import ChatCompletionRequest, CompletionRequest, Timings
from dwdp_worker.front.serving_metrics import RequestLoad, ServingMetrics


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from dwdp_worker.checkpoint.synth import write_tokenizer

    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(d, vocab_size=256)
    return AutoTokenizer.from_pretrained(str(d))


def _plan(tok, **body):
    return plan_completion(CompletionRequest(**body), tok)


def test_prompt_forms_become_one_plan_per_prompt_in_order(tok):
    assert [p.prompt for p in _plan(tok, prompt=[5, 6]).prompts] == [[5, 6]]
    assert [p.prompt for p in _plan(tok, prompt=[[5], [6, 7]]).prompts] == [[5], [6, 7]]
    plans = _plan(tok, prompt=["hello world", "the model"]).prompts
    assert [p.index for p in plans] == [0, 1]
    assert [p.prompt for p in plans] == ["hello world", "the model"] and plans[0].max_tokens == 1
    assert [p.prompt for p in _plan(tok, prompt=[]).prompts] == [[]]  # admission refuses it with the reason


@pytest.mark.parametrize("field,value", [("temperature", 0.7), ("top_p", 0.9), ("n", 2), ("best_of", 3),
                                         ("presence_penalty", 0.5), ("frequency_penalty", 1),
                                         ("logit_bias", {"5": 10}), ("suffix", "x"), ("top_k", 40),
                                         ("repetition_penalty", 1.2)])
def test_answer_changing_parameters_are_400_naming_the_field(tok, field, value):
    with pytest.raises(OpenAIRequestError) as e:
        _plan(tok, prompt=[1], **{field: value})
    assert e.value.status == 400 and e.value.param == field and field in str(e.value)


def test_neutral_values_unknown_fields_and_seed_are_accepted_and_unknown_logged_once(tok, caplog):
    body = dict(prompt=[1], temperature=0, top_p=1, n=1, seed=123, presence_penalty=0, top_k=-1,
                some_gateway_field={"x": 1})
    with caplog.at_level(logging.WARNING, logger="dwdp_worker.openai"):
        a = _plan(tok, **body)
        b = _plan(tok, **body)
    assert a.ignored_fields == b.ignored_fields == ("some_gateway_field",)
    assert sum("some_gateway_field" in r.getMessage() for r in caplog.records) == 1


def test_scoring_needs_echo_and_strict_types_stay_422(tok):
    p = _plan(tok, prompt=[3, 4, 5], echo=True, logprobs=2, max_tokens=0)
    assert p.prompts[0].score_prompt and p.prompts[0].max_tokens == 0 and p.top_n == 2
    with pytest.raises(OpenAIRequestError, match="echo"):
        _plan(tok, prompt=[1], max_tokens=0)
    for bad in ({"prompt": [1, "2"]}, {"prompt": [1.5]}, {"prompt": [1], "max_tokens": "3"},
                {"prompt": [1], "stream": "yes"}, {"prompt": "\ud800"}):
        with pytest.raises(ValidationError):
            CompletionRequest(**bad)


def test_stop_list_is_bounded_and_needs_a_tokenizer(tok):
    assert _plan(tok, prompt=[1], stop=["a", "b", "a"]).stop == ("a", "b")
    with pytest.raises(OpenAIRequestError, match="at most 4"):
        _plan(tok, prompt=[1], stop=list("abcde"))
    with pytest.raises(OpenAIRequestError, match="need a tokenizer"):
        plan_completion(CompletionRequest(prompt=[1], stop="x"), None)


def test_text_stream_never_leaks_a_stop_string_split_over_tokens(tok):
    ids = tok.encode("hello world the model expert", add_special_tokens=False)
    s = TextStream(tok, ("the model",))
    pieces = [s.push(ids[: i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == s.text == "hello world "
    assert s.stopped and s.tokens_kept == 4  # the token that completed "the model"
    plain = TextStream(tok)
    assert "".join(plain.push(ids[: i + 1]) for i in range(len(ids))) + plain.finish() == tok.decode(ids)


def test_echo_logprobs_lay_out_prompt_then_generation(tok):
    plan = _plan(tok, prompt="hello world", echo=True, logprobs=1, max_tokens=1)
    pp = plan.prompts[0]
    t = Timings(queue_s=0, compute_s=0, prefetch_wait_s=0, total_s=0, forwards=1, ranks=[0], batch_sequences=[1])
    o = PromptOutcome(plan=pp, prompt_tokens=tok.encode("hello world", add_special_tokens=False), generated=[99], logprobs=[-0.5], tops=[[(99, -0.5), (7, -1.0)]], timings=t,
                      prompt_logprobs=[-2.0], prompt_tops=[[(98, -1.5)]], text=tok.decode([99]))
    body = completion_response(plan, [o], tok, id="cmpl-x", created=1, model="m").model_dump()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["hello", "world", tok.decode([99])]
    assert lp["token_logprobs"] == [None, -2.0, -0.5]
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][2]) == 1
    assert lp["text_offset"] == [0, 5, 10]
    assert body["choices"][0]["text"] == "hello world" + tok.decode([99])
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    o.stopped_at(0)
    assert o.finish_reason is FinishReason.STOP and o.generated == []


def test_chat_renders_the_checkpoint_template_and_names_a_missing_one(tok):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hello world"}], max_tokens=2)
    plan = plan_chat(req, tok, chat.render)
    assert plan.prompts[0].prompt == "<s> user hello world </s> <s> assistant "
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hello world"}]}])
    assert plan_chat(parts, tok, chat.render).prompts[0].prompt == plan.prompts[0].prompt
    saved, tok.chat_template = tok.chat_template, None
    try:
        with pytest.raises(OpenAIRequestError, match="no chat template") as e:
            plan_chat(req, tok, chat.render)
        assert e.value.status == 400
    finally:
        tok.chat_template = saved


def test_serving_metrics_have_the_model_server_names():
    reg = CollectorRegistry()
    m = ServingMetrics(reg, lambda: RequestLoad(waiting=3, running=2))
    m.first_token(0.02)
    m.answered(prompt_tokens=5, generated_tokens=2, finished_reason="stop")
    out = generate_latest(reg).decode()
    for line in ("dwdp_num_requests_waiting 3.0", "dwdp_num_requests_running 2.0", "dwdp_prompt_tokens_total 5.0",
                 "dwdp_generation_tokens_total 2.0", 'dwdp_request_success_total{finished_reason="stop"} 1.0',
                 'dwdp_request_success_total{finished_reason="length"} 0.0',
                 "dwdp_time_to_first_token_seconds_count 1.0"):
        assert line in out, line
    assert "kv_cache_usage" not in out
    reg2 = CollectorRegistry()
    ServingMetrics(reg2, lambda: RequestLoad(waiting=0, running=0, kv_cache_usage=0.25))
    assert "dwdp_kv_cache_usage_perc 0.25" in generate_latest(reg2).decode()
