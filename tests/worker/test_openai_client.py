"""The real ``openai`` package against one real local group (1 group × 2 ranks, host backend, the tiny
tokenized qwen3_moe checkpoint with its chat template): batch, prompt scoring, stop, streaming, chat,
models, unknown fields, and errors as ``openai``'s typed exceptions — answers checked against the
unsharded ``transformers`` model. One server for the whole module (CI budget); the dashboard test
reads this real server's ``/metrics`` too."""

from __future__ import annotations

import json
import re

import openai
import pytest
import torch

from .serving_helpers import ROOT, local_group

DASHBOARD = ROOT / "charts/dwdp-operator/dashboards/dwdp.json"
PROMPT = [5, 17, 42, 99, 3]


@pytest.fixture(scope="module")
def server(model_dir):
    yield from local_group(model_dir, "--max-num-tokens", "48", "--batch-wait-ms", "30")


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def ref(model_dir):
    from dwdp_worker.launch.oracle import Reference

    return Reference(model_dir)


def _greedy(ref, tokens, steps, eos):
    """Greedy ids of the unsharded model, ending at (and including) EOS like the server."""
    seq, out = list(tokens), []
    for _ in range(steps):
        t = int(torch.argmax(ref.logits([seq])[0]))
        out.append(t)
        if t == eos:
            break
        seq.append(t)
    return out


def test_list_of_prompts_is_one_choice_each_in_order_packed(client, ref, tok):
    texts = ["hello world", "the model of a expert", "rank group weight"]
    r = client.completions.create(model="tiny", prompt=texts, max_tokens=2, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for text, c in zip(texts, r.choices):
        ids = tok.encode(text, add_special_tokens=False)
        want = _greedy(ref, ids, 2, tok.eos_token_id)
        assert c.token_ids == want
        assert c.text == tok.decode(want[:-1] if want[-1] == tok.eos_token_id else want)
        assert len(c.logprobs.token_logprobs) == len(want)
    assert r.usage.prompt_tokens == sum(len(tok.encode(t, add_special_tokens=False)) for t in texts)
    assert max(max(t["batch_sequences"]) for t in r.timings) >= 2, r.timings  # packed into shared forwards
    ids = client.completions.create(model="tiny", prompt=[PROMPT, [7, 8]], max_tokens=1)
    assert [c.token_ids for c in ids.choices] == [_greedy(ref, PROMPT, 1, None), _greedy(ref, [7, 8], 1, None)]


def test_echo_with_max_tokens_0_scores_the_prompt(client, ref, tok):
    r = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=2)
    c = r.choices[0]
    assert c.token_ids == [] and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert c.text == tok.decode(PROMPT)
    assert c.logprobs.tokens == [tok.decode([t]) for t in PROMPT]
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    want = [float(torch.log_softmax(ref.logits([PROMPT[: j + 1]])[0], -1)[PROMPT[j + 1]]) for j in range(4)]
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs[1:])
    both = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=1, logprobs=0)
    assert both.choices[0].logprobs.token_logprobs[1:5] == pytest.approx(want, abs=1e-4)
    assert both.choices[0].token_ids == _greedy(ref, PROMPT, 1, None)


def test_stop_string_ends_the_generation_where_it_completes(client, ref, tok):
    free = client.completions.create(model="tiny", prompt="hello world", max_tokens=4, extra_body={"ignore_eos": True})
    ids = free.choices[0].token_ids
    assert len(ids) == 4 and free.timings["forwards"] == 4
    stop = tok.decode([ids[1]])
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=4, stop=[stop],
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    first = tok.decode(ids[:1])
    if stop in first:  # the first token already contains it: nothing comes back
        assert c.text == first[: first.find(stop)]
    else:
        assert c.finish_reason == "stop" and stop not in c.text and c.token_ids == ids[:2]
        assert r.timings["forwards"] == 2  # no forward after the stop


def test_stream_completions_match_the_whole_answer_and_end_with_usage(client):
    whole = client.completions.create(model="tiny", prompt=["hello world", "the model"], max_tokens=3, seed=7)
    chunks = list(client.completions.create(model="tiny", prompt=["hello world", "the model"], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    for c in whole.choices:
        mine = [ch.choices[0] for ch in chunks[:-1] if ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == c.text
        assert [t for m in mine for t in m.token_ids] == c.token_ids
        assert [m.finish_reason for m in mine][-1] == c.finish_reason and all(m.finish_reason is None for m in mine[:-1])


def test_chat_uses_the_checkpoint_template(client, ref, tok):
    messages = [{"role": "system", "content": "hello world"}, {"role": "user", "content": "the model"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, logprobs=True, top_logprobs=2)
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = _greedy(ref, tok.encode(rendered, add_special_tokens=False), 3, tok.eos_token_id)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.token_ids == want and r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert [t.token for t in c.logprobs.content] == [tok.decode([t]) for t in want]
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert c.finish_reason == ("stop" if want[-1] == tok.eos_token_id else "length")
    parts = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, stream=True))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == c.message.content
    assert parts[-1].choices[0].finish_reason == c.finish_reason


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.owned_by == "dwdp" and m.max_model_len == 64 and m.has_chat_template is True
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert "not served" in e.value.message


def test_unknown_fields_and_neutral_sampling_values_are_accepted(client, ref):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, temperature=0, top_p=1, n=1, seed=3,
                                  user="u", extra_body={"top_k": -1, "some_gateway_field": {"a": 1},
                                                        "x-request-id": "abc"})
    assert r.choices[0].token_ids == _greedy(ref, PROMPT, 1, None)


@pytest.mark.parametrize("kwargs,exc,needle", [
    (dict(prompt=[1], temperature=0.7), openai.BadRequestError, "temperature"),
    (dict(prompt=[1], n=2), openai.BadRequestError, "n=2"),
    (dict(prompt=[1], max_tokens=0), openai.BadRequestError, "echo"),
    (dict(prompt=[1] * 70), openai.BadRequestError, "positions"),
    (dict(prompt=[[1], [1] * 70]), openai.BadRequestError, "prompt[1]"),
    (dict(prompt=[1], extra_body={"max_tokens": "3"}), openai.UnprocessableEntityError, "max_tokens"),
    (dict(prompt=[1], model="other"), openai.NotFoundError, "not served"),
    (dict(prompt=[[1]] * 300), openai.RateLimitError, "queue is full"),  # > --max-queue 256: all or nothing
])
def test_errors_are_openai_typed_exceptions(client, kwargs, exc, needle):
    kwargs.setdefault("model", "tiny")
    with pytest.raises(exc) as e:
        client.completions.create(**kwargs)
    assert needle in e.value.message
    assert e.value.body["message"] and "type" in e.value.body  # OpenAI's error object
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                       presence_penalty=1.0)


def _dashboard_metric_names() -> set[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"\b(dwdp_[a-z_]+)(?=\{|\[)", e)}  # a metric: selector or range


def test_dashboard_groups_by_labels_the_pod_monitor_adds():
    dash = json.loads(DASHBOARD.read_text())
    by = {lab.strip() for p in dash["panels"] for t in p["targets"]
          for group in re.findall(r"by \(([^)]*)\)", t["expr"]) for lab in group.split(",")}
    template = (ROOT / "charts/dwdp-operator/templates/podmonitor.yaml").read_text()
    target = re.search(r"podTargetLabels: \[([^\]]*)\]", template).group(1)
    relabeled = {re.sub(r"[^a-zA-Z0-9_]", "_", lab.strip()) for lab in target.split(",")}  # Prometheus' rule
    assert by - {"le", "code", "result"} <= relabeled, by - relabeled


def test_every_worker_metric_the_dashboard_queries_is_served(server, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)  # at least one of everything
    text = server.get("/metrics").text
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    wanted = _dashboard_metric_names()
    worker = {m for m in wanted if not m.startswith("dwdp_operator_")}
    assert len(worker) >= 12 and not worker - served, sorted(worker - served)
    from prometheus_client import REGISTRY, generate_latest

    import dwdp_operator.metrics  # noqa: F401 - registers the operator's metrics in the default registry
    operator_text = generate_latest(REGISTRY).decode()
    for m in wanted - worker:
        assert f"# TYPE {re.sub(r'_(bucket|count|sum)$', '', m)}" in operator_text, m
    for line in ("dwdp_num_requests_waiting 0.0", "dwdp_num_requests_running 0.0",
                 'dwdp_request_success_total{finished_reason="length"}'):
        assert line in text, line
    assert re.search(r"^dwdp_prompt_tokens_total [1-9]", text, re.M)
    assert re.search(r"^dwdp_time_to_first_token_seconds_count [1-9]", text, re.M)
