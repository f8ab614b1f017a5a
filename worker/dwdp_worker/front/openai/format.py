"""Internal outcomes → OpenAI response bodies and server-sent-event chunks (pure; no HTTP, no asyncio).

``TextStream`` turns the growing list of generated ids into text deltas with ``stop`` strings
applied; ``completion_response``/``chat_response`` build whole answers; ``*_chunk`` and ``sse`` build
the stream (``data: {json}\\n\\n`` per chunk, ending ``data: [DONE]\\n\\n``).

Invariants:
  * Choices come back in prompt order: ``index`` = the prompt's position in the request.
  * A stop string never reaches the client, not even split over two chunks: a stream holds back the
    last ``len(longest stop) - 1`` characters (and a trailing U+FFFD, half of a multi-byte character)
    until the next token shows they are not the start of a stop string.
  * ``token_ids`` and the log-probabilities of a stopped choice end with the token that completed
    the stop string; text ends before the stop string (OpenAI's and vLLM's convention). The
    tokenizer's end-of-sequence token ends a generation the same way (its text is not returned)
    unless the request sets ``ignore_eos`` (vLLM's field).
  * Completions with ``echo`` + ``logprobs``: ``tokens`` lists prompt then generated tokens; the
    first prompt token has no log-probability (``null``, nothing precedes it), like OpenAI.
    ``text_offset`` indexes the concatenation of ``tokens`` (cheap and exact for that string; it can
    differ from ``text`` where the tokenizer's decode joins tokens with spaces).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

from .. import text
from .requests import PromptPlan, RequestPlan
from .schemas import (AssistantMessage, ChatChoice, ChatCompletionResponse, ChoiceLogprobs, CompletionChoice,
                             CompletionLogprobs, CompletionResponse, Timings, TokenLogprob, TopLogprob, Usage)

SSE_DONE = b"data: [DONE]\n\n"
REPLACEMENT_CHAR = "\ufffd"  # what decode gives for an incomplete UTF-8 sequence (byte-level BPE mid-character)


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"


class TextStream:
    """Detokenize a growing generation; apply stop strings; hand out only text that is final."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), eos_id: int | None = None):
        self._tok, self.stops, self.eos_id = tokenizer, stops, eos_id
        self._hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""            # text decided so far (never contains a stop string)
        self.emitted = 0          # characters of ``text`` already handed out
        self.stopped = False
        self.tokens_kept: int | None = None

    def push(self, generated: list[int]) -> str:
        """Feed all generated ids so far; returns the new final text (may be empty)."""
        if self.stopped:
            return ""
        at_eos = bool(generated) and self.eos_id is not None and generated[-1] == self.eos_id
        full = text.decode(self._tok, generated[:-1] if at_eos else generated)
        cut = min((i for i in (full.find(s) for s in self.stops) if i >= 0), default=len(full) if at_eos else -1)
        if cut >= 0:
            self.stopped, self.tokens_kept = True, len(generated)
            self.text = full[:cut]
        else:
            safe = len(full) - self._hold
            while safe > 0 and full[safe - 1] == REPLACEMENT_CHAR:
                safe -= 1
            self.text = full
            return self._emit(max(self.emitted, safe))
        return self._emit(len(self.text))

    def finish(self) -> str:
        """The rest of the text (the generation ended by length)."""
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out


@dataclass
class PromptOutcome:
    """What the front computed for one prompt (built by the route from the supervisor's job)."""

    plan: PromptPlan
    prompt_tokens: list[int]                                        # the prompt as the model saw it
    generated: list[int]
    logprobs: list[float]
    tops: list[list[tuple[int, float]]]
    timings: Timings
    prompt_logprobs: list[float] = field(default_factory=list)        # positions 1.. of the prompt
    prompt_tops: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = FinishReason.LENGTH
    kv_transfer_params: dict | None = None   # the rank's KvTransferParams + prompt_token_ids (remote decode)

    def stopped_at(self, kept: int | None) -> None:
        """Keep the tokens up to the one that completed a stop string."""
        if kept is not None:
            self.generated, self.logprobs, self.tops = self.generated[:kept], self.logprobs[:kept], self.tops[:kept]
            self.finish_reason = FinishReason.STOP


def _top_dict(tokenizer, top: list[tuple[int, float]], n: int) -> dict[str, float]:
    return {text.token_str(tokenizer, i): float(v) for i, v in top[:n]}


def completion_logprobs(tokenizer, o: PromptOutcome, *, echo: bool, top_n: int, offset0: int = 0) -> CompletionLogprobs:
    ids, lps, tops = [], [], []
    if echo:
        n = len(o.prompt_tokens)
        ids += o.prompt_tokens
        lps += [None] + list(o.prompt_logprobs) if o.plan.score_prompt else [None] * n
        tops += [None] + [_top_dict(tokenizer, t, top_n) for t in o.prompt_tops] if o.plan.score_prompt \
            else [None] * n
    ids += o.generated
    lps += o.logprobs
    tops += [_top_dict(tokenizer, t, top_n) for t in o.tops]
    strs = [text.token_str(tokenizer, i) for i in ids]
    offsets, at = [], offset0
    for s in strs:
        offsets.append(at)
        at += len(s)
    return CompletionLogprobs(tokens=strs, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


def echo_text(o: PromptOutcome, tokenizer) -> str:
    """The prompt as echoed: the text as sent, or the decoded ids (empty without a tokenizer)."""
    return o.plan.prompt if isinstance(o.plan.prompt, str) else text.decode(tokenizer, o.prompt_tokens)


def _usage(outcomes: list[PromptOutcome]) -> Usage:
    p = sum(len(o.prompt_tokens) for o in outcomes)
    c = sum(len(o.generated) for o in outcomes)
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def completion_response(plan: RequestPlan, outcomes: list[PromptOutcome], tokenizer, *, id: str, created: int,
                        model: str, kv_origin: tuple[str | None, int | None] = (None, None)) -> CompletionResponse:
    """``kv_origin``: (``remote_host``, ``remote_port``) written into every choice's ``kv_transfer_params``."""
    choices = []
    host, port = kv_origin
    for o in sorted(outcomes, key=lambda o: o.plan.index):
        prefix = echo_text(o, tokenizer) if plan.echo else ""
        lp = completion_logprobs(tokenizer, o, echo=plan.echo, top_n=plan.top_n) if plan.logprobs else None
        kv = ({**o.kv_transfer_params, "model": model, "remote_host": host, "remote_port": port}
              if o.kv_transfer_params else None)
        choices.append(CompletionChoice(index=o.plan.index, text=prefix + o.text, token_ids=o.generated, logprobs=lp,
                                        finish_reason=o.finish_reason.value, kv_transfer_params=kv))
    timings = outcomes[0].timings if len(outcomes) == 1 else [o.timings for o in outcomes]
    return CompletionResponse(id=id, created=created, model=model, choices=choices, usage=_usage(outcomes),
                              timings=timings)


def chat_logprobs(tokenizer, ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]],
                  top_n: int) -> ChoiceLogprobs:
    def entry(i: int, v: float) -> TopLogprob:
        s = text.token_str(tokenizer, i)
        return TopLogprob(token=s, logprob=float(v), bytes=list(s.encode("utf-8")))

    content = [TokenLogprob(**entry(i, v).model_dump(), top_logprobs=[entry(j, w) for j, w in top[:top_n]])
               for i, v, top in zip(ids, lps, tops)]
    return ChoiceLogprobs(content=content)


def chat_response(plan: RequestPlan, o: PromptOutcome, tokenizer, *, id: str, created: int,
                  model: str) -> ChatCompletionResponse:
    lp = chat_logprobs(tokenizer, o.generated, o.logprobs, o.tops, plan.top_n) if plan.logprobs else None
    choice = ChatChoice(index=0, message=AssistantMessage(content=o.text), logprobs=lp,
                        finish_reason=o.finish_reason.value, token_ids=o.generated)
    return ChatCompletionResponse(id=id, created=created, model=model, choices=[choice], usage=_usage([o]),
                                  timings=o.timings)


# -- streaming ----------------------------------------------------------------------------------------
def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n\n"


def completion_chunk(*, id: str, created: int, model: str, index: int, text_delta: str,
                     token_ids: list[int], logprobs: CompletionLogprobs | None,
                     finish_reason: FinishReason | None) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text_delta, "token_ids": token_ids,
                         "logprobs": logprobs.model_dump() if logprobs else None,
                         "finish_reason": finish_reason.value if finish_reason else None}]}


def chat_chunk(*, id: str, created: int, model: str, delta: dict, logprobs: ChoiceLogprobs | None = None,
               finish_reason: FinishReason | None = None, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs.model_dump() if logprobs else None,
              "finish_reason": finish_reason.value if finish_reason else None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}


def usage_chunk(*, id: str, created: int, model: str, object: str, outcomes: list[PromptOutcome]) -> dict:
    """The last chunk before ``[DONE]`` when ``stream_options.include_usage`` is set: no choices, the usage."""
    return {"id": id, "object": object, "created": created, "model": model, "choices": [],
            "usage": _usage(outcomes).model_dump()}
