"""Dispatch: the FIFO of pending steps, packing them onto idle ranks, and folding results back into jobs.

Runs on the event loop thread only (no locks). Pipeline of one request::

    enqueue ─► queue (FIFO of Jobs, one pending step each)
            ─► _dispatch: idle ready rank with the fewest busy ranks in its group, then the fewest
               sequences served (ranks of different groups are independent replicas: least-loaded wins)
               ─► batcher.pack (prefix of the queue, ≤ max_num_tokens) ─► Forward to the rank
            ─► on_result: append the greedy token (none for max_tokens 0: prompt scoring only);
               on_step says stop (a stop string, EOS) or max_tokens reached? finish : re-queue at the head

A rank lost by an elastic group (``expert_replicas`` r ≥ 2, issue #30; the supervisor decides that the group
survives, ``dwdp_runtime.membership.group_survives``): the dead rank is never ``ready``, so nothing more is
dispatched to it, and each job of the step it held gets ``rerun_or_refuse``:
  * ``RERUN``: back at the head of the queue, in its order, with every token it already has (greedy decoding is
    deterministic and the lost step's result never reached the front: nothing is answered twice or skipped);
  * ``REFUSE_KV``: its prompt's KV was kept on the dead rank (``kv_transfer_params``): gone → 503 + Retry-After;
  * ``REFUSE_BUDGET``: already re-run ``MAX_RERUNS`` times (a request that kills every rank it meets must not
    take the group down one rank at a time) → 503 + Retry-After.
Queued jobs are not touched.

Invariants:
  * Every enqueued job is finished exactly once (``finish``): a result, an error, or cancelled.
  * A cancelled job (its client went away) leaves the queue at once; a step of it already on a rank
    finishes there, and the job is not re-queued: the rank stops working for it at its next step.
  * A rank holds at most one step batch (``RankHandle.batch``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Callable

from ..rank import protocol as p
from .batcher import pack, queued_tokens, requeue_front
from .errors import ForwardFailed, KvBudgetFull, ServeError, Unavailable
from .metrics import Metrics
from .rank_handle import InFlight, RankHandle
from .serving_metrics import ServingMetrics

log = logging.getLogger("dwdp_worker.front.dispatch")

#: greedy tokens one step decodes with the KV cache (``Forward.max_new_tokens``): a longer request takes
#: several steps, so cancellation, drain and the forward watchdog keep their per-step granularity
DECODE_CHUNK = 16


#: re-runs of one request after rank losses before it is refused: one loss is bad luck, two is a pattern
MAX_RERUNS = 1


class LossOutcome(StrEnum):
    RERUN = "rerun"
    REFUSE_KV = "refused_kv_lost"
    REFUSE_BUDGET = "refused_rerun_budget"


def rerun_or_refuse(*, reruns: int, kv_on_lost_rank: bool) -> LossOutcome:
    """What becomes of a job whose step was on a rank an elastic group lost (module docstring). Pure."""
    if kv_on_lost_rank:
        return LossOutcome.REFUSE_KV
    if reruns >= MAX_RERUNS:
        return LossOutcome.REFUSE_BUDGET
    return LossOutcome.RERUN


@dataclass(eq=False)
class Job:
    tokens: list[int]
    max_tokens: int
    top_n: int
    future: asyncio.Future
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex[:24]}")
    prompt_len: int = 0
    t_admit: float = field(default_factory=time.monotonic)
    t_enqueued: float = 0.0
    t_first: float | None = None
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    compute_s: float = 0.0
    prefetch_wait_s: float = 0.0
    ranks: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    score_prompt: bool = False       # echo + logprobs: the first forward also scores every prompt token
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_tops: list[list[tuple[int, float]]] = field(default_factory=list)
    on_step: Callable[["Job"], bool] | None = None  # after each of its forwards; True = finish now
    kv_request_id: str | None = None   # keep this prompt's KV for a remote decode (kv_transfer_params)
    kv_params: dict | None = None      # the rank's KvTransferParams once kept
    reruns: int = 0                    # times re-queued after the rank holding its step was lost (front.elastic)

    def __post_init__(self):
        self.prompt_len = len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)


class Dispatcher:
    def __init__(self, ranks: list[RankHandle], metrics: Metrics, *, max_num_tokens: int, max_num_seqs: int,
                 batch_wait_s: float, serving: ServingMetrics | None = None):
        self.ranks, self.metrics, self.serving = ranks, metrics, serving
        self.max_num_tokens, self.max_num_seqs, self.batch_wait_s = max_num_tokens, max_num_seqs, batch_wait_s
        self.queue: deque[Job] = deque()
        self.jobs: set[Job] = set()
        self.cancelled = 0
        self.failing: str | None = None  # once set, continuing jobs end with a 503 at their next step
        self._batch_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._kick_handle = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # -- jobs -------------------------------------------------------------------------------------------
    def enqueue(self, tokens: list[int], *, max_tokens: int, top_n: int, score_prompt: bool = False,
                on_step: Callable[[Job], bool] | None = None, remote_decode: bool = False) -> Job:
        job = Job(tokens=list(tokens), max_tokens=max_tokens, top_n=top_n, future=self._loop.create_future(),
                  score_prompt=score_prompt, on_step=on_step)
        if remote_decode:
            job.kv_request_id = job.id
        job.t_enqueued = time.monotonic()
        self.jobs.add(job)
        self.queue.append(job)
        self.metrics.inflight.set(len(self.jobs))
        self.kick()
        return job

    def finish(self, job: Job, error: ServeError | None = None) -> None:
        self.jobs.discard(job)
        self.metrics.inflight.set(len(self.jobs))
        if job.future.done():
            return
        if error is None:
            job.future.set_result(job)
        else:
            job.future.set_exception(error)

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job now; a step of it on a rank is its last."""
        if job.future.done():
            return
        try:
            self.queue.remove(job)
        except ValueError:
            pass  # on a rank right now: on_result will not re-queue it
        self.cancelled += 1
        self.jobs.discard(job)
        self.metrics.inflight.set(len(self.jobs))
        job.future.cancel()

    def fail_queued(self, error: ServeError) -> None:
        while self.queue:
            self.finish(self.queue.popleft(), error)

    def fail_all(self, error: ServeError) -> None:
        """Answer every job, queued or on a rank, with ``error`` (the front is stopping)."""
        self.fail_queued(error)
        for job in list(self.jobs):
            self.finish(job, error)

    # -- rank events ------------------------------------------------------------------------------------
    def on_result(self, h: RankHandle, msg: p.StepResult) -> None:
        held = h.take_batch(msg.batch_id)
        if held is None:
            log.error("%s answered batch %s it does not hold (ignored)", h.describe(), msg.batch_id)
            return
        now = time.monotonic()
        self.metrics.forward.observe(now - held.sent_at)
        continuing = []
        scores = msg.prompt or [None] * len(held.jobs)
        for i, job in enumerate(held.jobs):
            if job.future.done():
                continue  # cancelled: the client went away
            if scores[i] is not None:
                job.prompt_logprobs, job.prompt_tops = scores[i].logprobs, [t[: job.top_n] for t in scores[i].top]
            kept = msg.kv[i] if msg.kv else None
            if kept is not None and kept.error:
                self.finish(job, KvBudgetFull(kept.error))
                continue
            if kept is not None:
                job.kv_params = kept.params
            job.compute_s += msg.compute_s
            job.prefetch_wait_s += msg.prefetch_wait_s
            stopped = self._fold_tokens(job, h, msg, i, len(held.jobs), now)
            if stopped:
                self.finish(job)  # a stop string or end-of-sequence: no forward after it
            elif len(job.generated) >= job.max_tokens:
                self.finish(job)
            elif self.failing:
                self.finish(job, Unavailable(f"the server is failing ({self.failing}); retry on another replica"))
            else:
                job.tokens.extend(job.generated[len(job.tokens) - job.prompt_len:])
                continuing.append(job)
        requeue_front(self.queue, continuing)
        self.kick()

    def _fold_tokens(self, job: Job, h: RankHandle, msg: p.StepResult, i: int, batch: int, now: float) -> bool:
        """Append this step's tokens (the first, then the rank's continuation decoded with the KV cache) one
        by one, as if each came from its own forward: ``on_step`` (stop strings, EOS) sees every token and
        a stop drops the rest. True = the job stopped."""
        cont = msg.continuations[i] if msg.continuations else None
        steps = [(int(msg.next_ids[i]), float(msg.logprobs[i]), msg.top[i])] if job.max_tokens > 0 else []
        if cont is not None:
            steps += list(zip(cont.ids, cont.logprobs, cont.top))
        if not steps:  # max_tokens 0 (echo only): the forward scored the prompt
            job.ranks.append(h.gid)
            job.batch_sizes.append(batch)
            return job.on_step is not None and job.on_step(job)
        for k, (tok, lp, top) in enumerate(steps):
            job.ranks.append(h.gid)
            job.batch_sizes.append(batch if k == 0 else 1)  # the packed prefill, then batch-1 decode forwards
            job.generated.append(tok)
            job.logprobs.append(lp)
            job.tops.append(top[: job.top_n])
            if len(job.generated) == 1 and self.serving is not None:
                self.serving.first_token(now - job.t_admit)
            if job.on_step is not None and job.on_step(job):
                return True
            if len(job.generated) >= job.max_tokens:
                break
        return False

    def on_step_failed(self, h: RankHandle, msg: p.StepFailed) -> None:
        held = h.take_batch(msg.batch_id)
        if held is None:
            return
        for job in held.jobs:
            self.finish(job, ForwardFailed(f"the forward failed on {h.describe()}: {msg.message}"))
        self.kick()

    def on_rank_gone(self, h: RankHandle, error: ServeError) -> None:
        """The rank died or was killed: its step's jobs end with ``error``."""
        held, h.batch = h.batch, None
        if held is not None:
            for job in held.jobs:
                self.finish(job, error)

    def on_rank_lost_elastic(self, h: RankHandle) -> dict[str, int]:
        """An elastic group lost ``h``: its step's jobs are re-run on a survivor or refused retryably
        (``front.elastic.rerun_or_refuse``); returns the count per outcome."""
        held, h.batch = h.batch, None
        counts: dict[str, int] = {}
        rerun = []
        for job in held.jobs if held is not None else []:
            if job.future.done():
                continue  # cancelled: the client went away
            outcome = rerun_or_refuse(reruns=job.reruns, kv_on_lost_rank=job.kv_request_id is not None and bool(job.ranks))
            counts[outcome] = counts.get(outcome, 0) + 1
            self.metrics.rank_loss.labels(outcome=str(outcome)).inc()
            if outcome is LossOutcome.RERUN:
                job.reruns += 1
                rerun.append(job)
            else:
                why = ("its KV cache was kept on that rank" if outcome is LossOutcome.REFUSE_KV
                       else f"it was already re-run {job.reruns} time(s) after a rank loss")
                self.finish(job, Unavailable(f"{h.describe()} was lost while serving this request and {why}; "
                                             f"retry (the group keeps serving with its other ranks)"))
        requeue_front(self.queue, rerun)
        self.kick()
        return counts

    # -- dispatch ---------------------------------------------------------------------------------------
    def kick(self) -> None:
        if self._loop is not None and self._kick_handle is None:
            self._kick_handle = self._loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        self._kick_handle = None
        while self.queue:
            idle = [h for h in self.ranks if h.ready and h.batch is None]
            if not idle:
                return
            head = self.queue[0]
            if self.batch_wait_s > 0 and not head.generated:
                waited = time.monotonic() - head.t_enqueued
                if waited < self.batch_wait_s and queued_tokens(self.queue) < self.max_num_tokens:
                    self._loop.call_later(self.batch_wait_s - waited, self.kick)
                    return
            busy: dict[int, int] = {}
            for h in self.ranks:
                busy[h.spec.group] = busy.get(h.spec.group, 0) + (h.batch is not None)
            rank = min(idle, key=lambda h: (busy[h.spec.group], h.dispatched, h.gid))
            jobs = [j for j in pack(self.queue, max_num_tokens=self.max_num_tokens, max_num_seqs=self.max_num_seqs)
                    if not j.future.done()]
            if not jobs:
                continue
            self._send(rank, jobs)

    def _send(self, rank: RankHandle, jobs: list[Job]) -> None:
        batch_id = next(self._batch_ids)
        try:
            rank.send(_forward(batch_id, jobs))
        except OSError as exc:
            log.error("could not send a batch to %s: %s", rank.describe(), exc)
            requeue_front(self.queue, jobs)
            rank.phase = p.RankPhase.UNREACHABLE
            return
        now = time.monotonic()
        rank.batch = InFlight(batch_id, jobs, now)
        rank.dispatched += len(jobs)
        for j in jobs:
            if j.t_first is None:
                j.t_first = now
                self.metrics.queue_wait.observe(now - j.t_admit)
        self.metrics.batch_sequences.observe(len(jobs))
        self.metrics.batch_tokens.observe(sum(len(j) for j in jobs))

    def publish_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.queue))
        self.metrics.queue_tokens.set(queued_tokens(self.queue))
        self.metrics.inflight.set(len(self.jobs))


def _forward(batch_id: int, jobs: list[Job]) -> p.Forward:
    """One step: without a cache when every job wants one token and no KV (the context-only path, as
    before); else with it: up to ``DECODE_CHUNK`` tokens per job, KV kept for those that asked."""
    sequences, top_n = [list(j.tokens) for j in jobs], max(j.top_n for j in jobs)
    score = [j.score_prompt and not j.ranks for j in jobs]  # scored once: in its first forward
    new = [max(1, min(DECODE_CHUNK, j.max_tokens - len(j.generated))) for j in jobs]
    if any(score) or (all(n == 1 for n in new) and not any(j.kv_request_id for j in jobs)):
        # prompt scores need the no-cache forward (one token each this step; the admission refuses
        # kv_transfer_params with prompt scoring)
        return p.Forward(batch_id, sequences, top_n, score if any(score) else None)
    return p.Forward(batch_id, sequences, top_n, max_new_tokens=new,
                     keep_kv=[j.kv_request_id if not j.generated else None for j in jobs])
