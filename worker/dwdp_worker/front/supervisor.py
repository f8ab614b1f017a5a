"""The front's lifecycle: start the ranks and the tokenizer, admit requests, watch, fail, drain, stop.

Used by both the pod entrypoint (one rank per local GPU) and the local launcher (G×D ranks), through
``launch``. Everything runs on the asyncio loop thread, except the ranks' reader threads (they only
post messages onto the loop) and tokenizing (a small thread pool: it must not block the loop).

Invariants:
  * Every admitted request is answered exactly once: a result, a forward error (500), a 503 when its
    rank dies, the drain deadline passes or the front fails, or nothing when its client went away
    (cancelled). Nothing waits forever: a rank busy beyond ``forward_timeout_s``, or a ready rank
    silent beyond ``heartbeat_timeout_s`` (frozen: its heartbeat thread beats through forwards), is
    killed, which takes the death path.
  * Any rank exiting that the front did not stop, or reporting a lost peer, is a failure: queued
    requests get 503 at once, in-flight ones at their next step (≤ ``timeouts.FAILED_DRAIN_S``),
    readiness goes false, and ``exit_code`` becomes 1 (the operator restarts the group).
  * Drain (SIGTERM): readiness false at once, new requests 503, every admitted request finishes
    (bounded by ``drain_timeout_s``), then ranks are told to stop; ``exit_code`` 0.
  * Prefill load (``GET /v1/load``, the ``dwdp_prefill_*`` gauges): the front feeds
    ``dwdp_runtime.load.LoadEstimator`` with what it knows anyway — each admitted prompt's length, each
    answered forward's sequence lengths and wall time, each request's first-token time against the
    estimate it had at admission — and reads its queue from the job set at report time, so the
    waiting/running tokens cannot drift from the jobs.
"""

from __future__ import annotations

import asyncio
import logging
import pathlib
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from dwdp_runtime.config import DwdpConfig
from dwdp_runtime.load.estimator import LoadEstimator, QueueState
from dwdp_runtime.layout import coverage
from dwdp_runtime.membership import group_survives
from dwdp_runtime.load.schema import LoadReport
from dwdp_runtime.serving_options import ServingOptions

from . import probes
from ..rank import timeouts
from ..rank import protocol as p
from .admission import Limits, Param, Refusal, admit, new_tokens_fit, text_fits
from .dispatch import Dispatcher, Job
from .errors import BadPrompt, NotReady, QueueFull, Unavailable
from .metrics import Metrics
from ..kv.metrics import budget_summary
from .serving_metrics import RequestLoad, ServingMetrics
from .rank_handle import RankHandle
from . import text

log = logging.getLogger("dwdp_worker.front.supervisor")

#: threads that tokenize text prompts (and load the tokenizer): off the event loop, and few, so a burst
#: of long prompts queues here instead of taking every core from the ranks.
TOKENIZER_THREADS = 2


class Supervisor:
    def __init__(self, specs: list[p.RankSpec], *, model_dir: str, options: ServingOptions, group_attempt: int = 0,
                 batch_wait_s: float = 0.0, heartbeat_timeout_s: float = timeouts.HEARTBEAT_TIMEOUT_S,
                 forward_timeout_s: float = timeouts.FORWARD_TIMEOUT_S,
                 drain_timeout_s: float = timeouts.DRAIN_TIMEOUT_S, stop_timeout_s: float = timeouts.STOP_TIMEOUT_S,
                 kv_advertise_host: str | None = None, max_rank_respawns: int = timeouts.MAX_RANK_RESPAWNS):
        if not specs:
            raise ValueError("a front needs at least one rank")
        self.ranks = [RankHandle(s) for s in specs]
        self.model_dir, self.group_attempt, self.options = str(model_dir), group_attempt, options
        self.model_name = options.served_model_name or pathlib.Path(model_dir).name
        self.kv_enabled = any(h.spec.kv.enabled for h in self.ranks)
        self.kv_advertise_host = kv_advertise_host   # remote_host of KV responses (launch: kv.address)
        self.http_port: int | None = None            # the bound port, set by serve() once it listens
        self.heartbeat_timeout_s, self.forward_timeout_s = heartbeat_timeout_s, forward_timeout_s
        self.drain_timeout_s, self.stop_timeout_s = drain_timeout_s, stop_timeout_s
        self.max_rank_respawns = max_rank_respawns  # replacements of one lost rank of an elastic group (0: none)
        self.draining = False
        self.failure: str | None = None
        self.exit_code = 0
        self.tokenizer = None          # the checkpoint's, loaded off the event loop at start
        self.max_token_chars = 1
        self.tokenizer_ready = not text.has_tokenizer_files(model_dir)
        self.started_at = time.time()
        self.metrics = Metrics(self.snapshot)
        self.load = LoadEstimator(max_num_tokens=options.max_num_tokens, start=time.monotonic())
        self._predicted_ttft: weakref.WeakKeyDictionary[Job, float] = weakref.WeakKeyDictionary()
        self.serving = ServingMetrics(self.metrics.registry, self.request_load, prefill=self.load_report)
        self.dispatch = Dispatcher(self.ranks, self.metrics, max_num_tokens=options.max_num_tokens,
                                   max_num_seqs=options.max_num_seqs, batch_wait_s=batch_wait_s, serving=self.serving)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping_ranks = False
        self._store_generations: dict[str, int] = {}   # group → the newest store generation its ranks reported
        self._text_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="dwdp-tokenize")

    @property
    def jobs(self) -> set[Job]:
        return self.dispatch.jobs

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.dispatch.bind(self._loop)
        for h in self.ranks:
            h.spawn(self._post, self._on_message, self._on_exit)
            log.info("started %s on %s", h.describe(), h.spec.device or "cpu")
        self._tasks.append(asyncio.create_task(self._watchdog()))
        if not self.tokenizer_ready:
            self._tasks.append(asyncio.create_task(self._load_tokenizer()))

    async def _load_tokenizer(self) -> None:
        try:
            tok = await self._loop.run_in_executor(self._text_pool, text.load_tokenizer, self.model_dir)
            self.max_token_chars = await self._loop.run_in_executor(self._text_pool, text.max_token_chars, tok)
            self.tokenizer = tok
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
        """Wait (bounded) for admitted requests; after a failure only one more step."""
        limit = min(self.drain_timeout_s, timeouts.FAILED_DRAIN_S) if self.failure else self.drain_timeout_s
        deadline = time.monotonic() + limit
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self.dispatch.fail_all(Unavailable(f"the server stopped before this request finished "
                                           f"({'failure' if self.failure else 'drain'} deadline {limit:g} s)"))

    async def stop_ranks(self) -> None:
        self._stopping_ranks = True
        for t in self._tasks:
            t.cancel()
        for h in self.ranks:
            h.stopping = True
            if not h.dead and h.conn is not None:
                try:
                    h.send(p.Stop())
                except OSError:
                    pass
        # A failed front does not wait: the group is broken (a live rank's release barrier would wait for
        # the dead one), the pod is about to be restarted, and a process exit frees a rank's memory.
        grace = 0.0 if self.failure else self.stop_timeout_s
        deadline = time.monotonic() + grace
        for h in self.ranks:
            if h.proc is None:
                continue
            if grace > 0:
                await asyncio.to_thread(h.proc.join, max(0.1, deadline - time.monotonic()))
                if h.proc.is_alive():
                    log.warning("%s did not stop within %g s: killing it", h.describe(), grace)
            h.kill()
        for h in self.ranks:
            if h.proc is not None:
                await asyncio.to_thread(h.proc.join, timeouts.REAP_S)
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    def fail(self, why: str) -> None:
        """The front cannot go on: queued requests 503 now, in-flight ones at their next step, exit code 1."""
        log.error("front failing: %s", why)
        if self.failure is None:
            self.failure = why
        self.exit_code = 1
        self.dispatch.failing = self.failure
        self.dispatch.fail_queued(Unavailable(f"the server is failing ({why}); retry on another replica"))
        self.request_drain("failure")

    # -- rank messages (loop thread) ------------------------------------------------------------------
    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed: the front is exiting

    def _on_message(self, h: RankHandle, msg: p.RankMessage) -> None:
        h.apply(msg, time.monotonic())
        if isinstance(msg, p.StepResult):
            self._observe_forward(h, msg)
            self.dispatch.on_result(h, msg)
        elif isinstance(msg, p.StepFailed):
            self.dispatch.on_step_failed(h, msg)
        elif isinstance(msg, p.Ready):
            log.info("%s ready (vocab %d, max positions %d)", h.describe(), msg.info.vocab_size,
                     msg.info.max_positions)
            if h.respawns:
                log.warning("%s rejoined its group: the group is full again", h.describe())
                self.metrics.rank_rejoins.labels(group=str(h.spec.group)).inc()
            self.dispatch.kick()
        elif isinstance(msg, p.LoadProgress):
            log.info("%s load: %s: %s", h.describe(), msg.step, msg.detail)
        elif isinstance(msg, p.MembershipChanged):
            self._on_membership(h, msg)
        elif isinstance(msg, p.ExpertsReloaded):
            log.warning("%s: membership epoch %d: reloaded experts %s from the checkpoint (no surviving holder; "
                        "%s bytes read, %.2f s)", h.describe(), msg.epoch, list(msg.experts), msg.bytes_read,
                        msg.seconds)
            self.metrics.experts_reloaded.labels(group=str(h.spec.group)).inc(len(msg.experts))
        elif isinstance(msg, p.StoreMoved):
            self._on_store_moved(h, msg)
        elif isinstance(msg, p.PeerLost):
            if not (self._stopping_ranks or h.stopping):
                self.fail(f"{h.describe()}: {msg.message}")
        elif isinstance(msg, p.Fatal):
            log.error("%s failed: %s", h.describe(), msg.message)

    def _on_exit(self, h: RankHandle, code: int | None) -> None:
        if h.dead:
            return
        h.dead, h.exitcode = True, code
        if not (self._stopping_ranks or h.stopping) and self._survives_elastically(h):
            h.retired = True
            counts = self.dispatch.on_rank_lost_elastic(h)
            log.warning("%s exited with code %s%s; its elastic group keeps serving (its requests: %s)", h.describe(),
                        code, f" ({h.fatal})" if h.fatal else "", counts or "none in flight")
            self._respawn(h)
            return
        self.dispatch.on_rank_gone(h, Unavailable(
            f"{h.describe()} died (exit code {code}) while serving this request; the pod is restarting, "
            f"retry on another replica"))
        if self._stopping_ranks or h.stopping:
            return
        why = f"{h.describe()} exited unexpectedly with code {code}"
        if h.fatal:
            why += f": {h.fatal}"
        self.fail(why)

    def _respawn(self, h: RankHandle) -> None:
        """Start a replacement process for the lost rank ``h`` (it rejoins its running group: issue #30), within the
        rank's respawn budget and unless the front is stopping."""
        if self.draining or self.failure or self._stopping_ranks:
            return
        if h.respawns >= self.max_rank_respawns:
            log.error("%s: not restarting it (%d replacement(s) already, --max-rank-respawns %d); its group serves "
                      "degraded", h.describe(), h.respawns, self.max_rank_respawns)
            return
        new = h.replacement()
        self.ranks[self.ranks.index(h)] = new   # the dispatcher shares this list
        new.spawn(self._post, self._on_message, self._on_exit)
        self.metrics.rank_respawns.labels(group=str(h.spec.group)).inc()
        log.warning("restarting DWDP rank %d of group %d as %s (replacement %d of at most %d): it rejoins the "
                    "running group", h.spec.rank, h.spec.group, new.describe(), new.respawns, self.max_rank_respawns)

    def _on_store_moved(self, h: RankHandle, msg: p.StoreMoved) -> None:
        """Every rank of the group reports the same move: counted once per generation."""
        group = str(h.spec.group)
        if msg.generation > self._store_generations.get(group, 0):
            self._store_generations[group] = msg.generation
            self.metrics.store_failovers.labels(group=group).inc()
            self.metrics.store_generation.labels(group=group).set(msg.generation)
            log.warning("group %s: its store moved from DWDP rank %d to rank %d's standby (generation %d, %.2f s on "
                        "%s)", group, msg.lost_host, msg.new_host, msg.generation, msg.seconds, h.describe())

    def _survives_elastically(self, h: RankHandle) -> bool:
        """Whether ``h``'s group (expert replicas) still covers every expert without its dead ranks (a replacement
        still loading serves nothing yet: its rank counts as lost)."""
        config = DwdpConfig(**h.spec.config)
        lost = {g.spec.rank for g in self.ranks if g.spec.group == h.spec.group and (g.dead or g.rejoining)}
        self.metrics.coverage_margin.labels(group=str(h.spec.group)).set(coverage(config.holders(), lost))
        return group_survives(config, lost)

    def _on_membership(self, h: RankHandle, msg: p.MembershipChanged) -> None:
        """A survivor re-planned: a member the group excluded (fenced: frozen, or cut off) is killed now, so
        its requests re-run at once instead of at the heartbeat timeout."""
        log.warning("%s: membership epoch %d, members %s (re-plan %.3f s)", h.describe(), msg.epoch,
                    list(msg.alive), msg.replan_s)
        self.metrics.membership_epoch.labels(group=str(h.spec.group)).set(msg.epoch)
        self.metrics.replans.labels(group=str(h.spec.group)).inc()
        self.metrics.replan_seconds.labels(group=str(h.spec.group)).observe(msg.replan_s)
        self.metrics.members_ready.labels(group=str(h.spec.group)).set(len(msg.alive))
        for g in self.ranks:  # a replacement not admitted yet is outside the membership by design
            if g.spec.group == h.spec.group and g.spec.rank not in msg.alive and not g.dead and not g.rejoining:
                self._kill(g, f"was excluded from its group at membership epoch {msg.epoch}")
        if msg.unreadable:
            log.error("%s could not import the memory of rejoined rank(s) %s: it plans without them", h.describe(),
                      list(msg.unreadable))

    def _kill(self, h: RankHandle, why: str) -> None:
        log.error("%s %s: killing it", h.describe(), why)
        if h.fatal is None:
            h.fatal = why
        h.kill()

    async def _watchdog(self) -> None:
        # Heartbeat ages are enforced once a rank is ready: while it loads, a long call that holds the GIL
        # (CUDA context creation, kernel compilation) may delay a beat, and a false kill would restart the
        # whole group; a rank stuck loading is bounded by its peers' rendezvous timeout instead.
        while True:
            await asyncio.sleep(timeouts.WATCHDOG_TICK_S)
            now = time.monotonic()
            for h in self.ranks:
                if h.dead or h.fatal:
                    continue
                if h.batch is not None and now - h.batch.sent_at > self.forward_timeout_s:
                    self._kill(h, f"is stuck in a forward for {now - h.batch.sent_at:.0f} s "
                                  f"(limit {self.forward_timeout_s:g} s)")
                elif h.phase == p.RankPhase.READY and h.heartbeat_age(now) > self.heartbeat_timeout_s:
                    self._kill(h, f"sent no heartbeat for {h.heartbeat_age(now):.1f} s (limit "
                                  f"{self.heartbeat_timeout_s:g} s; frozen or hung)")
            self.dispatch.publish_gauges()

    # -- requests -------------------------------------------------------------------------------------
    def limits(self) -> Limits | None:
        for h in self.ranks:
            if h.phase == p.RankPhase.READY and h.info is not None:
                return Limits(max_num_tokens=self.options.max_num_tokens, vocab_size=h.info.vocab_size,
                              max_positions=h.info.max_positions, max_num_seqs=self.options.max_num_seqs,
                              max_new_tokens=self.options.max_new_tokens, kv_enabled=self.kv_enabled)
        return None

    def _refuse_if_closed(self) -> None:
        if self.failure:
            raise Unavailable(f"the server is failing: {self.failure}")
        if self.draining:
            raise Unavailable("the server is draining (stopping): it accepts no new requests; retry on another replica")

    def request_load(self) -> RequestLoad:
        """The model-server protocol's load gauges (``serving_metrics``): sequences waiting and running, and
        the KV budget in use once ranks report a KV region (``kv.metrics.budget_summary``; absent before)."""
        waiting = sum(1 for j in self.jobs if j.t_first is None)
        now = time.monotonic()
        kv = budget_summary(h.snapshot(now) for h in self.ranks)
        return RequestLoad(waiting=waiting, running=len(self.jobs) - waiting,
                           kv_cache_usage=kv["use"] if kv else None)

    async def submit(self, prompt: str | list[int], *, max_tokens: int, top_n: int, score_prompt: bool = False,
                     on_step: Callable[[Job], bool] | None = None, remote_decode: bool = False) -> Job:
        """Admit and enqueue one request; raises ``ServeError`` (400/429/503) with the reason.
        ``score_prompt``/``on_step``: see ``dispatch.Job`` (the OpenAI layer's echo scoring, stop strings);
        ``remote_decode``: keep the prompt's KV for a decode engine (``kv_transfer_params``)."""
        self._refuse_if_closed()
        limits = self.limits()
        if limits is None or not self.tokenizer_ready or not any(h.ready for h in self.ranks):
            raise NotReady("the server is not ready yet (ranks are starting or loading weights); see /readyz")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadPrompt("this checkpoint has no tokenizer: send prompt as a list of token ids")
            refusal = text_fits(prompt, max(1, max_tokens), limits, self.max_token_chars)
            if refusal:
                raise BadPrompt(refusal.message, param=refusal.param)
            tokens = await self._loop.run_in_executor(self._text_pool, text.encode, self.tokenizer, prompt)
            self._refuse_if_closed()  # the drain may have started while tokenizing
        else:
            tokens = prompt
        # max_tokens 0 (scoring) still runs the prompt once
        refusal = admit(tokens, max(1, max_tokens), limits)
        if refusal is None and remote_decode and score_prompt:
            refusal = Refusal("kv_transfer_params.do_remote_decode cannot be combined with echo + logprobs (prompt "
                              "scoring): send them as two requests", Param.KV_TRANSFER_PARAMS)
        refusal = refusal or new_tokens_fit(max_tokens, remote_decode, limits)
        if refusal:
            raise BadPrompt(refusal.message, param=refusal.param)
        if len(self.dispatch.queue) >= self.options.max_queue:
            raise QueueFull(f"the request queue is full ({self.options.max_queue} waiting); retry later")
        now = time.monotonic()
        predicted = self.load.ttft_estimate(len(tokens), self.prefill_queue(), self._ready_ranks(), now)
        job = self.dispatch.enqueue(tokens, max_tokens=max_tokens, top_n=top_n, score_prompt=score_prompt,
                                    on_step=on_step, remote_decode=remote_decode)
        self.load.admitted(len(tokens), now)
        if predicted is not None:
            self._predicted_ttft[job] = predicted
        return job

    def cancel(self, job: Job) -> None:
        self.dispatch.cancel(job)

    # -- prefill load ---------------------------------------------------------------------------------
    def _observe_forward(self, h: RankHandle, msg: p.StepResult) -> None:
        """A forward answered (before dispatch folds it): its sequences' lengths and wall time, and the
        first-token time of the requests this was the first forward of."""
        held = h.batch
        if held is None or held.batch_id != msg.batch_id:
            return
        now = time.monotonic()
        self.load.forward_done(h.gid, [len(j) for j in held.jobs], now - held.sent_at, now)
        for job in held.jobs:
            if not job.ranks and not job.future.done():
                self.load.first_token(now - job.t_admit, self._predicted_ttft.pop(job, None), now)

    def _ready_ranks(self) -> int:
        return sum(1 for h in self.ranks if h.ready)

    def prefill_queue(self) -> QueueState:
        running = [len(j) for h in self.ranks if h.batch is not None for j in h.batch.jobs if not j.future.done()]
        waiting = [len(j) for j in self.dispatch.queue if not j.future.done()]
        return QueueState.of(waiting, running, running_requests=len(self.jobs) - len(waiting))

    def load_report(self, isl: int | None = None) -> LoadReport:
        """``GET /v1/load``: this front's prefill load (``dwdp_runtime.load.schema``)."""
        return self.load.report(self.prefill_queue(), ranks=self._ready_ranks(), ready=self.snapshot()["ready"],
                                draining=self.draining, now=time.monotonic(), isl=isl)

    # -- views ----------------------------------------------------------------------------------------
    @property
    def kv_origin(self) -> tuple[str | None, int | None]:
        """(``remote_host``, ``remote_port``) of this server's KV responses."""
        return self.kv_advertise_host, self.http_port

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        snap = {"draining": self.draining, "failure": self.failure, "group_attempt": self.group_attempt,
                "tokenizer_ready": self.tokenizer_ready, "ranks": [h.snapshot(now) for h in self.ranks]}
        snap["ready"] = probes.evaluate(snap, heartbeat_timeout_s=self.heartbeat_timeout_s)[1]
        return snap

    def probe(self) -> tuple[bool, bool, dict[str, Any]]:
        snap = self.snapshot()
        live, ready, body = probes.evaluate(snap, heartbeat_timeout_s=self.heartbeat_timeout_s)
        body.update(model=self.model_name, queue_depth=len(self.dispatch.queue), inflight=len(self.jobs),
                    cancelled=self.dispatch.cancelled)
        return live, ready, body
