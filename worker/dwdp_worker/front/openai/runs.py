"""One OpenAI request's prompts on the front: admit all, enqueue all, await all, or cancel all.

``PromptRun`` follows one prompt: its job on the front, the text decided so far (``TextStream``:
stop strings and end-of-sequence applied after every forward, on the event loop thread), and what a
stream has already sent.

Invariants:
  * All or nothing: every prompt of a request is admitted before any is enqueued; if one cannot be
    enqueued or fails, the others are cancelled and the request gets that one error.
  * A cancelled run (its client went away) leaves the front's queue and is never re-queued.
  * ``on_step`` returns True at the forward that completes a stop string or emits EOS, so the front
    runs no forward after it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..dispatch import Job
from ..errors import BadPrompt, NotReady, ServeError
from .format import PromptOutcome, TextStream
from .requests import PromptPlan, RequestPlan
from .schemas import Timings
from ..supervisor import Supervisor


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def not_ready() -> ServeError:
    return NotReady("the server is not ready yet (ranks are starting or loading weights); see /readyz")


@dataclass
class PromptRun:
    """One prompt of a request on its way through the front."""

    plan: PromptPlan
    stream: TextStream
    job: Job | None = None
    events: asyncio.Queue | None = None   # streaming: the run puts itself here after each forward
    unsent_text: str = ""                 # final text not yet streamed
    sent_tokens: int = 0                  # generated tokens already streamed
    echo_sent: bool = False

    def on_step(self, job: Job) -> bool:
        """After each forward (loop thread): fold the new text in; True ends the generation (a stop string)."""
        self.unsent_text += self.stream.push(job.generated)
        if self.events is not None:
            self.events.put_nowait(self)
        return self.stream.stopped

    def take_text(self, *, final: bool) -> str:
        if not self.stream.stopped:
            self.unsent_text += self.stream.push(self.job.generated)
        if final:
            self.unsent_text += self.stream.finish()
        out, self.unsent_text = self.unsent_text, ""
        return out

    def take_tokens(self) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
        job = self.job
        end = self.stream.tokens_kept if self.stream.tokens_kept is not None else len(job.generated)
        start, self.sent_tokens = self.sent_tokens, max(self.sent_tokens, end)
        return job.generated[start:end], job.logprobs[start:end], job.tops[start:end]

    def outcome(self, t_now: float, *, generated_only: tuple | None = None) -> PromptOutcome:
        job = self.job
        ids, lps, tops = generated_only or (job.generated, job.logprobs, job.tops)
        o = PromptOutcome(plan=self.plan, prompt_tokens=list(job.tokens[: job.prompt_len]), generated=list(ids),
                          logprobs=list(lps), tops=list(tops), timings=timings_of(job, t_now),
                          prompt_logprobs=list(job.prompt_logprobs), prompt_tops=list(job.prompt_tops),
                          kv_transfer_params=({**job.kv_params, "prompt_token_ids": list(job.tokens[: job.prompt_len])}
                                              if job.kv_params else None))
        if generated_only is None:
            self.take_text(final=True)
            o.stopped_at(self.stream.tokens_kept)
            o.text = self.stream.text
        return o


def timings_of(job: Job, now: float) -> Timings:
    return Timings(queue_s=round((job.t_first or now) - job.t_admit, 6), compute_s=round(job.compute_s, 6),
                   prefetch_wait_s=round(job.prefetch_wait_s, 6), total_s=round(now - job.t_admit, 6),
                   forwards=len(job.ranks), ranks=job.ranks, batch_sequences=job.batch_sizes)


def eos_id(tokenizer) -> int | None:
    return getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None


async def submit_all(sup: Supervisor, plan: RequestPlan, *, streaming: bool) -> list[PromptRun]:
    """Admit and enqueue every prompt of ``plan`` (tokenized by the front, off the loop); all or nothing."""
    if not sup.tokenizer_ready:
        raise not_ready()
    eos = eos_id(sup.tokenizer) if plan.stop_at_eos else None
    watch = bool(plan.stop) or eos is not None or streaming
    events = asyncio.Queue() if streaming else None
    runs = [PromptRun(plan=p, stream=TextStream(sup.tokenizer, plan.stop, eos), events=events) for p in plan.prompts]
    try:
        for run in runs:
            try:
                run.job = await sup.submit(run.plan.prompt, max_tokens=run.plan.max_tokens, top_n=run.plan.top_n,
                                           score_prompt=run.plan.score_prompt, on_step=run.on_step if watch else None,
                                           remote_decode=run.plan.remote_decode)
            except BadPrompt as exc:
                if len(runs) == 1:
                    raise
                raise BadPrompt(f"prompt[{run.plan.index}]: {exc}", param=exc.param) from None
    except BaseException:
        cancel_all(sup, runs)
        raise
    return runs


def cancel_all(sup: Supervisor, runs: list[PromptRun]) -> None:
    for r in runs:
        if r.job is not None and not r.job.future.done():
            sup.cancel(r.job)


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    raise ClientGone


async def await_all(sup: Supervisor, runs: list[PromptRun], receive) -> None:
    """Every prompt's answer; the first error (the others cancelled); ``ClientGone`` on a disconnect."""
    gone = asyncio.ensure_future(_until_disconnect(receive))
    futures = [r.job.future for r in runs]
    try:
        pending = set(futures)
        while pending:
            done, pending = await asyncio.wait(pending | {gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                gone.result()  # raises ClientGone
            pending.discard(gone)
            for f in done:
                if f.cancelled():
                    raise not_ready()  # cancelled by the front (stopping)
                if f.exception() is not None:
                    raise f.exception()
    finally:
        gone.cancel()
        cancel_all(sup, runs)
def count_answered(sup: Supervisor, outcomes: list[PromptOutcome]) -> None:
    for o in outcomes:
        sup.serving.answered(prompt_tokens=len(o.prompt_tokens), generated_tokens=len(o.generated),
                             finished_reason=o.finish_reason.value)
