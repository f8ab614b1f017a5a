"""Server-sent events of one OpenAI request: chunks in the order forwards finish, ``data: [DONE]`` last.

Invariants:
  * Each prompt's last chunk carries its finish reason; chat streams start with the assistant role.
  * An error after the first byte is an OpenAI error object in a ``data:`` event (the ``openai``
    package raises it), then ``data: [DONE]``; before the first byte errors are plain HTTP errors.
  * With ``stream_options.include_usage`` the last chunk before ``[DONE]`` has no choices and the usage.
  * A client that disconnects (the generator is closed) cancels the prompts still running.
"""

from __future__ import annotations

import asyncio
import time

from .format import (SSE_DONE, FinishReason, chat_chunk, chat_logprobs, completion_chunk, completion_logprobs,
                            echo_text, sse, usage_chunk)
from .requests import Endpoint, OpenAIRequestError, RequestPlan
from .runs import PromptRun, count_answered, not_ready
from ..schemas import error_json
from ..errors import ServeError
from ..supervisor import Supervisor


def error_event(exc: BaseException) -> bytes:
    if isinstance(exc, OpenAIRequestError):
        return sse(error_json(str(exc), type=exc.type, param=exc.param, code=exc.code))
    kind = exc.kind if isinstance(exc, ServeError) else "server_error"
    return sse(error_json(str(exc), type=kind))


async def stream_events(sup: Supervisor, plan: RequestPlan, runs: list[PromptRun], *, id: str,
                  created: int):
    """Chunks in the order forwards finish; each prompt's last chunk carries its finish reason."""
    events: asyncio.Queue = runs[0].events
    pending = {r.plan.index: r for r in runs}
    for r in runs:
        r.job.future.add_done_callback(lambda _f, r=r: events.put_nowait(r))
    chat_mode = plan.endpoint is Endpoint.CHAT
    try:
        if chat_mode:
            yield sse(chat_chunk(id=id, created=created, model=sup.model_name,
                                 delta={"role": "assistant", "content": ""}))
        while pending:
            r = await events.get()
            if r.plan.index not in pending:
                continue
            fut = r.job.future
            done = fut.done()
            if done and (fut.cancelled() or fut.exception() is not None):
                yield error_event(fut.exception() if not fut.cancelled() else not_ready())
                yield SSE_DONE
                return
            chunk = (_chat_delta if chat_mode else _completion_delta)(sup, plan, r, id=id, created=created, final=done)
            if chunk is not None:
                yield sse(chunk)
            if done:
                del pending[r.plan.index]
        now = time.monotonic()
        outcomes = [r.outcome(now) for r in runs]
        count_answered(sup, outcomes)
        if plan.include_usage:
            yield sse(usage_chunk(id=id, created=created, model=sup.model_name,
                                  object="chat.completion.chunk" if chat_mode else "text_completion",
                                  outcomes=outcomes))
        yield SSE_DONE
    finally:
        for r in runs:
            if not r.job.future.done():
                sup.cancel(r.job)  # the client went away mid-stream


def _finish_reason(r: PromptRun, final: bool) -> FinishReason | None:
    if not final:
        return None
    return FinishReason.STOP if r.stream.stopped else FinishReason.LENGTH


def _chat_delta(sup: Supervisor, plan: RequestPlan, r: PromptRun, *, id: str, created: int, final: bool):
    text_delta = r.take_text(final=final)
    ids, lps, tops = r.take_tokens()
    finish = _finish_reason(r, final)
    if not text_delta and not ids and finish is None:
        return None
    lp = chat_logprobs(sup.tokenizer, ids, lps, tops, plan.top_n) if plan.logprobs and ids else None
    return chat_chunk(id=id, created=created, model=sup.model_name,
                      delta={"content": text_delta} if text_delta or ids else {}, logprobs=lp,
                      finish_reason=finish, token_ids=ids)


def _completion_delta(sup: Supervisor, plan: RequestPlan, r: PromptRun, *, id: str, created: int, final: bool):
    text_delta = r.take_text(final=final)
    ids, lps, tops = r.take_tokens()
    finish = _finish_reason(r, final)
    echo = plan.echo and not r.echo_sent
    if not echo and not text_delta and not ids and finish is None:
        return None
    partial = r.outcome(time.monotonic(), generated_only=(ids, lps, tops))
    if echo:
        r.echo_sent = True
        text_delta = echo_text(partial, sup.tokenizer) + text_delta
    lp = completion_logprobs(sup.tokenizer, partial, echo=echo, top_n=plan.top_n) if plan.logprobs else None
    return completion_chunk(id=id, created=created, model=sup.model_name, index=r.plan.index, text_delta=text_delta,
                            token_ids=ids, logprobs=lp, finish_reason=finish)
