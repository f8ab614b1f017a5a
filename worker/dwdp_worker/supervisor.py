"""The front: rank processes, the bounded request queue, packing, dispatch, drain and exit code.

Used by both the pod entrypoint (one rank per local GPU) and the local launcher (G×D ranks).
Everything below runs on the asyncio loop thread except one reader thread per rank, which only
forwards the rank's messages onto the loop (``call_soon_threadsafe``).

Pipeline of one request::

    api: admit (400) ─► submit: draining? 503 · not ready? 503 · queue full? 429
         ─► queue (FIFO of Jobs, one pending step each)
         ─► _dispatch: idle ready rank with the fewest busy ranks in its group, then the fewest
            sequences served (ranks are independent replicas: least-loaded wins)
            ─► batcher.pack (prefix of the queue, ≤ max_num_tokens) ─► ("forward", …) to the rank
         ─► _on_result: append the greedy token; max_tokens reached? answer : re-queue at the head

Invariants:
  * Every admitted request is answered exactly once: a result, a forward error (500), or a 503
    when its rank dies, the drain deadline passes or the front fails. Nothing waits forever: a
    rank busy beyond ``forward_timeout_s`` is killed, which takes the death path.
  * A rank holds at most one batch at a time; ``RankHandle.batch`` is the only record of it.
  * Any rank exiting that the front did not stop is a failure: in-flight and queued requests get
    503, readiness goes false, and ``exit_code`` becomes 1 (the operator restarts the group).
  * Drain (SIGTERM): readiness false at once, new requests 503, every admitted request finishes
    (bounded by ``drain_timeout_s``), then ranks are told to stop; ``exit_code`` 0.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from . import probes
from .batcher import Limits, pack, queued_tokens, requeue_front
from .metrics import Metrics
from .rank_process import RankSpec, rank_main
from .text import has_tokenizer_files, load_tokenizer

log = logging.getLogger("dwdp_worker.supervisor")


class ServeError(Exception):
    status = 500
    kind = "server_error"


class Unavailable(ServeError):
    status, kind = 503, "unavailable"


class QueueFull(ServeError):
    status, kind = 429, "queue_full"


class ForwardFailed(ServeError):
    status, kind = 500, "forward_failed"


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

    def __post_init__(self):
        self.prompt_len = len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)


class RankHandle:
    """The front's side of one rank process."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.proc = None
        self.conn = None
        self.phase = "spawned"
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.last_msg = time.monotonic()
        self.batch: tuple[int, list[Job], float] | None = None
        self.dispatched = 0
        self.front_forwards = 0
        self.compute_s = 0.0
        self.prefetch_wait_s = 0.0
        self.last_forward_end: float | None = None
        self.fatal: str | None = None
        self.exitcode: int | None = None
        self.dead = False
        self.stopping = False

    @property
    def gid(self) -> int:
        return self.spec.global_id

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and not self.dead and not self.stopping

    def describe(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"rank {self.gid} (group {self.spec.group}, DWDP rank {self.spec.rank}, pid {pid})"

    def snapshot(self, now: float) -> dict[str, Any]:
        s = self.stats
        return {
            "global_id": self.gid, "group": self.spec.group, "rank": self.spec.rank,
            "pid": self.proc.pid if self.proc else None, "device": self.spec.device or "cpu",
            "phase": self.phase, "alive": not self.dead, "exitcode": self.exitcode,
            "busy": self.batch is not None,
            "busy_s": round(now - self.batch[2], 3) if self.batch else None,
            "heartbeat_age_s": round(now - self.last_msg, 3),
            "forwards": int(s.get("forwards", self.front_forwards) or 0),
            "prefetch_restarts": int(s.get("prefetch_restarts", 0) or 0),
            "prefetch_bytes": int(s.get("prefetch_bytes", 0) or 0),
            "remote_bytes_per_forward": int(s.get("remote_bytes_per_forward", 0) or 0),
            "backend": s.get("backend"),
            "compute_s": round(self.compute_s, 6), "prefetch_wait_s": round(self.prefetch_wait_s, 6),
            "sequences_served": self.dispatched,
            "last_forward_age_s": (round(now - self.last_forward_end, 3)
                                   if self.last_forward_end is not None else None),
        }


class Supervisor:
    def __init__(self, specs: list[RankSpec], *, model_dir: str, model_name: str, group_attempt: int = 0,
                 max_num_tokens: int = 8192, max_num_seqs: int = 256, max_queue: int = 256,
                 batch_wait_s: float = 0.0, heartbeat_timeout_s: float = 30.0,
                 forward_timeout_s: float = 300.0, drain_timeout_s: float = 60.0, stop_timeout_s: float = 20.0):
        if not specs:
            raise ValueError("a front needs at least one rank")
        self.ranks = [RankHandle(s) for s in specs]
        self.model_dir, self.model_name, self.group_attempt = str(model_dir), model_name, group_attempt
        self.max_num_tokens, self.max_num_seqs, self.max_queue = max_num_tokens, max_num_seqs, max_queue
        self.batch_wait_s, self.heartbeat_timeout_s = batch_wait_s, heartbeat_timeout_s
        self.forward_timeout_s, self.drain_timeout_s, self.stop_timeout_s = forward_timeout_s, drain_timeout_s, stop_timeout_s
        self.queue: deque[Job] = deque()
        self.jobs: set[Job] = set()
        self.draining = False
        self.failure: str | None = None
        self.exit_code = 0
        self.tokenizer = None
        self.tokenizer_ready = not has_tokenizer_files(model_dir)
        self.started_at = time.time()
        self.metrics = Metrics(self.snapshot)
        self._batch_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = None
        self._kick_handle = None
        self._tasks: list[asyncio.Task] = []
        self._stopping_ranks = False

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        ctx = mp.get_context("spawn")
        for h in self.ranks:
            parent, child = ctx.Pipe(duplex=True)
            h.proc = ctx.Process(target=rank_main, args=(h.spec, child), name=f"dwdp-rank{h.gid}", daemon=False)
            h.proc.start()
            child.close()  # the child holds its own copy; ours would hide EOF when it dies
            h.conn = parent
            h.last_msg = time.monotonic()
            threading.Thread(target=self._reader, args=(h,), name=f"dwdp-reader{h.gid}", daemon=True).start()
            log.info("started %s on %s", h.describe(), h.spec.device or "cpu")
        self._tasks.append(asyncio.create_task(self._watchdog()))
        if not self.tokenizer_ready:
            self._tasks.append(asyncio.create_task(self._load_tokenizer()))

    async def _load_tokenizer(self) -> None:
        try:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_dir)
            self.tokenizer_ready = True
        except Exception as exc:  # noqa: BLE001 - a broken tokenizer is a start-up failure
            self.fail(f"could not load the tokenizer of {self.model_dir}: {type(exc).__name__}: {exc}")

    async def wait_stop_requested(self) -> None:
        await self._stop.wait()

    def request_drain(self, reason: str = "SIGTERM") -> None:
        """Readiness false now; the serve loop then drains and stops. Safe to call twice."""
        if not self.draining:
            log.warning("draining (%s): readiness false, finishing %d admitted request(s)", reason, len(self.jobs))
        self.draining = True
        if self._stop is not None:
            self._stop.set()

    async def drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for job in list(self.jobs):
            self._finish(job, Unavailable(f"the server stopped before this request finished "
                                          f"(drain timeout {self.drain_timeout_s:g} s)"))

    async def stop_ranks(self) -> None:
        self._stopping_ranks = True
        for t in self._tasks:
            t.cancel()
        for h in self.ranks:
            h.stopping = True
            if not h.dead and h.conn is not None:
                try:
                    h.conn.send(("stop",))
                except OSError:
                    pass
        # A failed front does not wait long: the group is broken (a peer's release barrier would
        # wait for a dead rank) and the pod is about to be restarted anyway.
        grace = min(self.stop_timeout_s, 2.0) if self.failure else self.stop_timeout_s
        deadline = time.monotonic() + grace
        for h in self.ranks:
            if h.proc is None:
                continue
            await asyncio.to_thread(h.proc.join, max(0.1, deadline - time.monotonic()))
            if h.proc.is_alive():
                log.warning("%s did not stop within %g s: killing it", h.describe(), grace)
                h.proc.kill()
                await asyncio.to_thread(h.proc.join, 5)

    # -- rank messages (loop thread) ---------------------------------------------------------------
    def _reader(self, h: RankHandle) -> None:
        try:
            while True:
                msg = h.conn.recv()
                self._post(self._on_message, h, msg)
        except (EOFError, OSError):
            pass
        except Exception as exc:  # noqa: BLE001 - an unpicklable message is a protocol bug
            log.error("reader of %s: %s", h.describe(), exc)
        h.proc.join(timeout=5)
        self._post(self._on_exit, h, h.proc.exitcode)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: the front is exiting

    def _on_message(self, h: RankHandle, msg: tuple) -> None:
        h.last_msg = time.monotonic()
        kind = msg[0]
        if kind == "phase":
            h.phase = msg[1]
        elif kind == "ready":
            h.info = msg[1]
            h.stats = msg[1].get("stats", {})
            h.last_forward_end = time.monotonic()  # the warm-up forward just finished
            h.phase = "ready"
            log.info("%s ready (vocab %s, max positions %s)", h.describe(), h.info.get("vocab_size"),
                     h.info.get("max_positions"))
            self._kick()
        elif kind == "hb":
            h.stats = msg[1]
        elif kind == "result":
            self._on_result(h, msg[1], msg[2])
        elif kind == "error":
            self._on_forward_error(h, msg[1], msg[2])
        elif kind == "fatal":
            h.fatal = msg[1]
            log.error("%s failed: %s", h.describe(), msg[1])

    def _on_result(self, h: RankHandle, batch_id: int, payload: dict) -> None:
        if h.batch is None or h.batch[0] != batch_id:
            log.error("%s answered batch %s it does not hold (ignored)", h.describe(), batch_id)
            return
        _, jobs, t_sent = h.batch
        h.batch = None
        now = time.monotonic()
        h.front_forwards += 1
        h.last_forward_end = now
        h.compute_s += payload["compute_s"]
        h.prefetch_wait_s += payload["prefetch_wait_s"]
        h.stats = payload.get("stats", h.stats)
        self.metrics.forward.observe(now - t_sent)
        continuing = []
        for i, job in enumerate(jobs):
            if job.future.done():
                continue  # the client went away
            tok = int(payload["next"][i])
            job.generated.append(tok)
            job.logprobs.append(float(payload["logprob"][i]))
            job.tops.append(payload["top"][i][: job.top_n])
            job.compute_s += payload["compute_s"]
            job.prefetch_wait_s += payload["prefetch_wait_s"]
            job.ranks.append(h.gid)
            job.batch_sizes.append(len(jobs))
            if len(job.generated) >= job.max_tokens:
                self._finish(job)
            elif self.failure:
                self._finish(job, Unavailable(f"the server is failing ({self.failure}); retry on another replica"))
            else:
                job.tokens.append(tok)
                continuing.append(job)
        requeue_front(self.queue, continuing)
        self._kick()

    def _on_forward_error(self, h: RankHandle, batch_id: int, message: str) -> None:
        if h.batch is None or h.batch[0] != batch_id:
            return
        _, jobs, _ = h.batch
        h.batch = None
        for job in jobs:
            self._finish(job, ForwardFailed(f"the forward failed on {h.describe()}: {message}"))
        self._kick()

    def _on_exit(self, h: RankHandle, code: int | None) -> None:
        if h.dead:
            return
        h.dead, h.exitcode = True, code
        if h.batch is not None:
            _, jobs, _ = h.batch
            h.batch = None
            for job in jobs:
                self._finish(job, Unavailable(f"{h.describe()} died (exit code {code}) while serving this "
                                              f"request; the pod is restarting, retry on another replica"))
        if self._stopping_ranks or h.stopping:
            return
        why = f"{h.describe()} exited unexpectedly with code {code}"
        if h.fatal:
            why += f": {h.fatal}"
        self.fail(why)

    def fail(self, why: str) -> None:
        """The front cannot go on: answer queued requests 503, stop accepting, exit code 1."""
        log.error("front failing: %s", why)
        if self.failure is None:
            self.failure = why
        self.exit_code = 1
        while self.queue:
            self._finish(self.queue.popleft(), Unavailable(f"the server is failing ({why}); retry on another replica"))
        self.request_drain("failure")

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            for h in self.ranks:
                if h.batch is not None and not h.dead and now - h.batch[2] > self.forward_timeout_s:
                    log.error("%s is stuck in a forward for %.0f s (limit %g s): killing it", h.describe(),
                              now - h.batch[2], self.forward_timeout_s)
                    h.proc.kill()
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.queue_tokens.set(queued_tokens(self.queue))
            self.metrics.inflight.set(len(self.jobs))

    # -- requests -----------------------------------------------------------------------------------
    def limits(self) -> Limits | None:
        for h in self.ranks:
            if h.phase == "ready" and h.info:
                return Limits(max_num_tokens=self.max_num_tokens, vocab_size=h.info["vocab_size"],
                              max_positions=h.info["max_positions"], max_num_seqs=self.max_num_seqs)
        return None

    async def submit(self, tokens: list[int], *, max_tokens: int, top_n: int) -> Job:
        if self.draining or self.failure:
            raise Unavailable("the server is draining (stopping): it accepts no new requests; retry on another replica"
                              if not self.failure else f"the server is failing: {self.failure}")
        if not any(h.ready for h in self.ranks) or not self.tokenizer_ready:
            raise Unavailable("the server is not ready yet (ranks are starting or loading weights); see /readyz")
        if len(self.queue) >= self.max_queue:
            raise QueueFull(f"the request queue is full ({self.max_queue} waiting); retry later")
        job = Job(tokens=list(tokens), max_tokens=max_tokens, top_n=top_n,
                  future=self._loop.create_future())
        job.t_enqueued = time.monotonic()
        self.jobs.add(job)
        self.queue.append(job)
        self.metrics.inflight.set(len(self.jobs))
        self._kick()
        try:
            return await job.future
        finally:
            self.jobs.discard(job)

    def _finish(self, job: Job, error: ServeError | None = None) -> None:
        self.jobs.discard(job)
        if job.future.done():
            return
        if error is None:
            job.future.set_result(job)
        else:
            job.future.set_exception(error)

    def _kick(self) -> None:
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
                    self._loop.call_later(self.batch_wait_s - waited, self._kick)
                    return
            busy = {}
            for h in self.ranks:
                busy[h.spec.group] = busy.get(h.spec.group, 0) + (h.batch is not None)
            rank = min(idle, key=lambda h: (busy[h.spec.group], h.dispatched, h.gid))
            jobs = pack(self.queue, max_num_tokens=self.max_num_tokens, max_num_seqs=self.max_num_seqs)
            jobs = [j for j in jobs if not j.future.done()]
            if not jobs:
                continue
            batch_id = next(self._batch_ids)
            top_n = max(j.top_n for j in jobs)
            try:
                rank.conn.send(("forward", batch_id, [list(j.tokens) for j in jobs], top_n))
            except OSError as exc:
                log.error("could not send a batch to %s: %s", rank.describe(), exc)
                requeue_front(self.queue, jobs)
                rank.phase = "unreachable"
                continue
            now = time.monotonic()
            rank.batch = (batch_id, jobs, now)
            rank.dispatched += len(jobs)
            for j in jobs:
                if j.t_first is None:
                    j.t_first = now
                    self.metrics.queue_wait.observe(now - j.t_admit)
            self.metrics.batch_sequences.observe(len(jobs))
            self.metrics.batch_tokens.observe(sum(len(j) for j in jobs))

    # -- views --------------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        snap = {"draining": self.draining, "failure": self.failure, "group_attempt": self.group_attempt,
                "tokenizer_ready": self.tokenizer_ready, "ranks": [h.snapshot(now) for h in self.ranks]}
        snap["ready"] = probes.evaluate(snap, heartbeat_timeout_s=self.heartbeat_timeout_s)[1]
        return snap

    def probe(self) -> tuple[bool, bool, dict[str, Any]]:
        snap = self.snapshot()
        live, ready, body = probes.evaluate(snap, heartbeat_timeout_s=self.heartbeat_timeout_s)
        body.update(model=self.model_name, queue_depth=len(self.queue), inflight=len(self.jobs))
        return live, ready, body
