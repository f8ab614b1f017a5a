"""OpenAI request → internal plan: what to run for each prompt, and why a request is refused.

Pure functions (no asyncio, no HTTP): ``plan_completion`` and ``plan_chat`` turn a parsed request
(``openai_schemas``) into a ``RequestPlan`` — one ``PromptPlan`` (the prompt, text or token ids, and
what to return) per prompt — or raise ``OpenAIRequestError`` with the HTTP status, the message and the
offending field. Tokenizing and admission stay with the front (``Supervisor.submit``), which does
them off the event loop for every endpoint alike.

Invariants:
  * This server decodes greedily and only greedily. A parameter that would change the answer away
    from greedy argmax over the raw logits (``UNSERVED`` below) is a 400 naming the field and the
    value that is served; its neutral value (``temperature: 0``, ``top_p: 1``, ``n: 1`` …) is
    accepted. ``seed`` is accepted and has no effect (greedy is deterministic).
  * Unknown fields are ignored; each unknown field name is logged once per process (a gateway that
    adds a field on every request must not flood the log).
  * A list of prompts is one choice per prompt, ``index`` = position in the list; each prompt is
    admitted on its own, and the request fails as a whole if one of them is refused.
  * ``max_tokens: 0`` is prompt scoring: only with ``echo`` (the answer is the prompt itself, with
    its log-probabilities when ``logprobs`` is set); it generates nothing.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from .schemas import MAX_STOP_SEQUENCES, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("dwdp_worker.openai")

DEFAULT_MAX_TOKENS = 1  # the context (prefill) phase: one forward, the first token


class OpenAIRequestError(Exception):
    """A request this server cannot serve as sent: HTTP status, message, and the field to change."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type


class Endpoint(str, Enum):
    COMPLETIONS = "completions"
    CHAT = "chat.completions"


@dataclass(frozen=True)
class PromptPlan:
    """One prompt: the tokens to run and what its choice returns."""

    index: int
    prompt: str | list[int]          # text (tokenized by the front) or token ids
    max_tokens: int
    top_n: int                       # top-N log-probabilities per generated token (0 = none)
    score_prompt: bool               # also return the log-probability of every prompt token (echo + logprobs)
    remote_decode: bool = False      # kv_transfer_params.do_remote_decode: keep its KV for a decode engine


@dataclass(frozen=True)
class RequestPlan:
    endpoint: Endpoint
    prompts: list[PromptPlan]
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: bool = False           # return log-probabilities at all (completions: logprobs set; chat: logprobs)
    top_n: int = 0
    stop: tuple[str, ...] = ()
    stop_at_eos: bool = True         # the tokenizer's end-of-sequence token ends a generation (not ignore_eos)
    ignored_fields: tuple[str, ...] = field(default=())


# -- parameters this server does not serve -----------------------------------------------------------
@dataclass(frozen=True)
class Unserved:
    neutral: Callable[[Any], bool]   # True when the value leaves the greedy answer unchanged
    served: str                      # what to send instead, for the message


def _is(*values) -> Callable[[Any], bool]:
    return lambda v: v is None or v in values


UNSERVED: dict[str, Unserved] = {
    "temperature": Unserved(_is(0), "temperature 0 (greedy decoding; the only mode of this context server)"),
    "top_p": Unserved(_is(1), "top_p 1 (greedy decoding)"),
    "n": Unserved(_is(1), "n 1 (one choice per prompt; send a list of prompts for several)"),
    "best_of": Unserved(_is(1), "best_of 1"),
    "presence_penalty": Unserved(_is(0), "presence_penalty 0"),
    "frequency_penalty": Unserved(_is(0), "frequency_penalty 0"),
    "repetition_penalty": Unserved(_is(1), "repetition_penalty 1"),
    "logit_bias": Unserved(lambda v: not v, "no logit_bias"),
    "suffix": Unserved(lambda v: v is None or v == "", "no suffix (insertion is not served)"),
    "top_k": Unserved(_is(-1, 0, 1), "top_k -1 (greedy decoding)"),
    "min_tokens": Unserved(_is(0), "min_tokens 0"),
    "tools": Unserved(lambda v: not v, "no tools (tool calling is not served)"),
    "tool_choice": Unserved(_is("none"), "no tool_choice"),
    "response_format": Unserved(lambda v: not v or (isinstance(v, dict) and v.get("type") == "text"),
                                "response_format {\"type\": \"text\"} (structured output is not served)"),
}

_logged_unknown: set[str] = set()
_logged_lock = threading.Lock()


def check_served(req: CompletionRequest | ChatCompletionRequest) -> None:
    """400 on the first parameter that would change the greedy answer."""
    values = {**req.model_dump(exclude_unset=True), **(req.model_extra or {})}
    for name, rule in UNSERVED.items():
        if name in values and not rule.neutral(values[name]):
            raise OpenAIRequestError(f"{name}={values[name]!r} is not served by this context server; send "
                                     f"{rule.served} or leave it out", param=name, code="unsupported_parameter")


def ignored_fields(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    """Unknown fields of this request; each name is logged once per process."""
    names = tuple(n for n in (req.model_extra or {}) if n not in UNSERVED)
    with _logged_lock:
        new = [n for n in names if n not in _logged_unknown]
        _logged_unknown.update(new)
    for n in new:
        log.warning("ignoring unknown request field %r (logged once per field name)", n)
    return names


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise OpenAIRequestError(f"stop: at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise OpenAIRequestError("stop: an empty string would stop before the first token", param="stop")
    return tuple(dict.fromkeys(stops))


# -- prompts ------------------------------------------------------------------------------------------
def completion_prompts(prompt) -> list[str | list[int]]:
    """One entry per prompt: a text, a list of texts, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], (list, str)):
        return list(prompt)
    if not prompt:
        return [[]]  # an empty token prompt: admission refuses it with the reason
    return [list(prompt)]


def _max_tokens(value: int | None, *, echo: bool, param: str = "max_tokens") -> int:
    n = DEFAULT_MAX_TOKENS if value is None else value
    if n == 0 and not echo:
        raise OpenAIRequestError(f"{param}=0 generates nothing: send max_tokens >= 1, or echo=true (with logprobs) "
                                 f"to score the prompt", param=param)
    return n


def _stop_needs_text(stops: tuple[str, ...], tokenizer) -> tuple[str, ...]:
    if stops and tokenizer is None:
        raise OpenAIRequestError("stop strings need a tokenizer (this checkpoint has none) to turn ids into text",
                                 param="stop")
    return stops


def plan_completion(req: CompletionRequest, tokenizer) -> RequestPlan:
    check_served(req)
    ignored = ignored_fields(req)
    max_tokens = _max_tokens(req.max_tokens, echo=req.echo)
    top_n = req.logprobs or 0
    score = req.echo and req.logprobs is not None
    remote = req.kv_transfer_params is not None and req.kv_transfer_params.do_remote_decode
    if remote and req.stream:   # a stream's chunks carry no kv_transfer_params: the KV would be kept for nobody
        raise OpenAIRequestError("kv_transfer_params.do_remote_decode needs stream=false: the answer carries the "
                                 "kv_transfer_params a decode engine pulls with (the prefill is one token anyway)",
                                 param="kv_transfer_params")
    prompts = [PromptPlan(index=i, prompt=prompt, max_tokens=max_tokens, top_n=top_n, score_prompt=score,
                          remote_decode=remote) for i, prompt in enumerate(completion_prompts(req.prompt))]
    return RequestPlan(endpoint=Endpoint.COMPLETIONS, prompts=prompts, stream=req.stream,
                       include_usage=bool(req.stream_options and req.stream_options.include_usage),
                       echo=req.echo, logprobs=req.logprobs is not None, top_n=top_n,
                       stop=_stop_needs_text(_stop(req.stop), tokenizer), stop_at_eos=not req.ignore_eos,
                       ignored_fields=ignored)


def plan_chat(req: ChatCompletionRequest, tokenizer, render: Callable[..., str]) -> RequestPlan:
    """``render(tokenizer, messages, add_generation_prompt)`` → the prompt text (``chat.render``)."""
    check_served(req)
    ignored = ignored_fields(req)
    if req.top_logprobs and not req.logprobs:
        raise OpenAIRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = _max_tokens(limit, echo=False,
                             param="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    if tokenizer is None:
        raise OpenAIRequestError("this checkpoint has no tokenizer: chat needs one (and a chat template); "
                                 "use /v1/completions with token ids", param="messages")
    rendered = render(tokenizer, [m.model_dump(exclude_none=True) for m in req.messages], req.add_generation_prompt)
    top_n = (req.top_logprobs or 0) if req.logprobs else 0
    prompt = PromptPlan(index=0, prompt=rendered, max_tokens=max_tokens, top_n=top_n, score_prompt=False)
    return RequestPlan(endpoint=Endpoint.CHAT, prompts=[prompt], stream=req.stream,
                       include_usage=bool(req.stream_options and req.stream_options.include_usage),
                       logprobs=req.logprobs, top_n=top_n, stop=_stop(req.stop), stop_at_eos=not req.ignore_eos,
                       ignored_fields=ignored)
