"""One DWDP rank as an OS process: rendezvous → Engine.build → warm-up → (join) → serve packed steps.

An elastic group's rank (issue #30) enters through ``dwdp_runtime.elastic.entry.open_group``: it forms the group
with the others, or — the group already runs, this process replaces a lost rank — it loads its share, warms up,
asks to join and serves once the members admitted it (phase ``joining``). Between forwards it applies every
membership epoch (losses and joins) and reports each store move (``StoreMoved``).

Started by the front (``rank_handle``) with ``multiprocessing`` ``spawn``; talks to it over one duplex
``Connection`` in the typed messages of ``protocol`` (the one definition both sides import).

Invariants:
  * The rank never dies on a bad batch: a forward exception is reported as ``StepFailed`` for that batch
    only (the front validated the requests; this is the last line of defence).
  * Heartbeats come from a thread every ``timeouts.RANK_HEARTBEAT_S``, also while a forward runs: only a
    frozen or dead process stops beating (a forward stuck on the device is the front's forward
    watchdog's job). A ``Heartbeat`` carries the stats of the last finished forward (never read while one
    runs).
  * A lost peer (``dwdp_runtime.monitor.PeerMonitor``: another rank of the group, maybe in another pod,
    stopped heart-beating, or the store host froze or died) is reported at once (``PeerLost``, from the
    monitor's thread, even mid-forward) and ends the rank with exit 1 at its next step.
  * The rank dies with its front: ``PR_SET_PDEATHSIG`` (Linux) kills it if the front dies, and a closed
    pipe ends the loop.
  * No named semaphore is created (tqdm's default lock is a ``multiprocessing`` RLock, a /dev/shm/sem.mp-*
    file that a SIGKILL leaves behind): the lock is a thread lock, set before anything makes a bar.
  * The rank never tokenizes: sequences are token ids (the front owns the tokenizer).
  * Greedy selection and log-probabilities are computed here (float32, ``log_softmax`` of the
    last-position logits), so only a few numbers per sequence cross the pipe.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
import uuid

from dwdp_runtime import compile_cache
from dwdp_runtime.contract import TuningEnv
from dwdp_runtime.serving_options import ELASTIC_GRAPHS_REASON

from . import protocol as p
from . import timeouts
from .membership import (apply_membership, group_fingerprint, join, membership_agent, peer_timing,
                         report_lost)
from .load_progress import report_bars_to
from .scoring import PromptScores, next_tokens, prompt_scores
from .startup import STEP as STARTUP_STEP

log = logging.getLogger("dwdp_worker.rank")


def _threads_only_tqdm_lock() -> None:
    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


class RankLink:
    """The rank's end of the pipe: sends are serialised (the main loop, the heartbeat thread and the peer
    monitor's thread all write), and the latest stats for the heartbeat."""

    def __init__(self, conn):
        self.conn = conn
        self._lock = threading.Lock()
        self.stats = p.RankStats()
        self.kv_stats = None  # the engine's KV store stats (thread-safe): fresh in every heartbeat, TTL frees show
        self.busy = False
        self.failovers_reported = 0  # store moves already sent to the front (StoreMoved)
        self._stop = threading.Event()

    def send(self, msg) -> None:
        with self._lock:
            self.conn.send(msg)

    def beat_forever(self) -> None:
        while not self._stop.wait(timeouts.RANK_HEARTBEAT_S):
            try:
                stats = self.stats if self.kv_stats is None else dataclasses.replace(self.stats, kv=self.kv_stats())
                self.send(p.Heartbeat(stats, busy=self.busy))
            except (OSError, ValueError):
                return  # the front is gone; the main loop notices too

    def start_heartbeat(self) -> None:
        threading.Thread(target=self.beat_forever, name="dwdp-rank-heartbeat", daemon=True).start()

    def stop_heartbeat(self) -> None:
        self._stop.set()


def _prompt_scores(res, msg: p.Forward) -> list[PromptScores | None] | None:
    if res.prompt_logits is None:
        return None
    return [None if lg is None else prompt_scores(lg, seq, msg.top_n)
            for lg, seq in zip(res.prompt_logits, msg.sequences)]


def rank_main(spec: p.RankSpec, conn) -> None:
    """Process entry point (top level, importable by ``spawn``)."""
    _threads_only_tqdm_lock()
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C goes to the front, which stops us in order
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # likewise: the front drains, then sends Stop()
    os.environ.update(spec.env)
    logging.basicConfig(level=os.environ.get(TuningEnv.LOG_LEVEL) or spec.log_level.upper(),
                        format=f"%(asctime)s rank{spec.global_id} %(levelname)s %(name)s: %(message)s")
    link = RankLink(conn)
    link.start_heartbeat()
    try:
        code = _serve(spec, link)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        code = 0  # the front is gone; nothing to report to
    except BaseException as exc:  # noqa: BLE001 - reported to the front, then exit non-zero
        msg = f"rank {spec.rank} of group {spec.group}: {type(exc).__name__}: {exc}"
        log.error("%s", msg)
        log.debug("%s", traceback.format_exc())  # operators get the reason; developers can ask for more
        try:
            link.send(p.Fatal(msg))
        except Exception:  # noqa: BLE001
            pass
        code = 1
    link.stop_heartbeat()
    try:
        conn.close()
    finally:
        os._exit(code)  # skip interpreter teardown of mapped shared memory and stray threads


def _serve(spec: p.RankSpec, link: RankLink) -> int:
    link.send(p.PhaseChanged(p.RankPhase.STARTING))
    caches = compile_cache.apply()  # before torch/triton read their cache variables
    cache_files = caches.entries()
    t_import = time.monotonic()
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.elastic.entry import claim_fingerprint, open_group
    from dwdp_runtime.monitor import PeerMonitor

    from ..checkpoint.identity import checkpoint_digest
    from .engine import Engine

    torch.set_num_threads(max(1, spec.threads))
    if spec.device and torch.device(spec.device).type == "cuda":
        compile_cache.prewarm_in_background()   # Triton's cache key hashed beside the load, not in the warm-up
    config = DwdpConfig(**spec.config)
    if config.elastic and spec.cuda_graphs:  # after a re-plan a replay would still read the lost rank's memory
        raise ValueError(f"expert_replicas={config.expert_replicas}, on_uncovered={config.on_uncovered} (an elastic "
                         f"group) cannot use CUDA graphs (cuda_graphs={spec.cuda_graphs}): {ELASTIC_GRAPHS_REASON}; "
                         f"set one of them off")
    dtype = getattr(torch, spec.dtype) if spec.dtype else None
    import_s = time.monotonic() - t_import
    link.send(p.PhaseChanged(p.RankPhase.RENDEZVOUS))
    t0 = time.monotonic()
    incarnation = f"{spec.global_id}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    fingerprint = group_fingerprint(config, spec, checkpoint_digest(spec.model_dir))
    entry = open_group(host=spec.store_host, port=spec.store_port, rank=spec.rank, world_size=config.dwdp_size,
                       job=spec.job, group=spec.group, attempt=spec.attempt, token=spec.token,
                       timeout_s=spec.rendezvous_timeout_s, elastic=config.elastic, fingerprint=fingerprint,
                       incarnation=incarnation, pod_addr_template=spec.pod_addr_template,
                       gpus_per_pod=spec.gpus_per_pod)
    with entry.rendezvous as rdzv:
        rendezvous_s = time.monotonic() - t0
        if entry.join is None:
            if config.elastic:
                claim_fingerprint(rdzv, fingerprint)  # before minutes of loading: every rank must serve the same
            link.send(p.LoadProgress("rendezvous", f"group of {config.dwdp_size} ranks formed in {rendezvous_s:.1f} s"))
        else:
            m = entry.join.membership
            link.send(p.LoadProgress("rendezvous", (
                f"the group runs (members {sorted(m.alive)} at epoch {m.epoch}, store generation {rdzv.generation}): "
                f"this process replaces DWDP rank {spec.rank} and joins it")))
        link.send(p.PhaseChanged(p.RankPhase.LOADING))
        t0 = time.monotonic()
        with report_bars_to(lambda step, detail: link.send(p.LoadProgress(step, detail))):
            engine = Engine.build(model_dir=spec.model_dir, config=config, rank=spec.rank, rendezvous=rdzv,
                                  backend=spec.backend, device=spec.device, token=spec.token, dtype=dtype,
                                  progress=True, copy_delay_s=_test_copy_delay(), kv=spec.kv,
                                  identity=_kv_identity(spec), cuda_graphs=spec.cuda_graphs,
                                  batch_invariant=spec.batch_invariant, incarnation=incarnation, join=entry.join)
        rep = engine.load_report
        link.send(p.LoadProgress("weights", (
            f"{len(rep.layers)} MoE layers, dense {rep.dense_bytes / 2**20:.1f} MiB, local experts "
            f"{rep.local_expert_bytes / 2**20:.1f} MiB of {rep.total_expert_bytes / 2**20:.1f} MiB, "
            f"handles exchanged and mapped, in {time.monotonic() - t0:.1f} s")))
        # Peers in other pods can die without this front noticing: the monitor heart-beats through
        # the group's store (side threads, off the forward path) and names a lost peer at once.
        elastic = config.elastic
        interval_s, dead_after_s = peer_timing(spec, elastic)
        monitor = PeerMonitor(rdzv, interval_s=interval_s, dead_after_s=dead_after_s, elastic=elastic,
                              beat_tag=incarnation, on_lost=lambda why: report_lost(link, why))
        agent = membership_agent(engine, rdzv, monitor, entry, incarnation) if elastic else None
        monitor.start()
        if agent is not None:
            agent.start()
        try:
            link.send(p.PhaseChanged(p.RankPhase.WARMUP))
            warm = [t % engine.vocab_size for t in spec.warmup_tokens][: max(1, engine.max_positions)]
            t_warm = time.monotonic()
            engine.forward([warm])
            startup = dataclasses.replace(engine.startup, import_s=import_s, rendezvous_s=rendezvous_s,
                                          warmup_s=time.monotonic() - t_warm, cache_files_before=cache_files,
                                          cache_files_after=caches.entries())
            link.send(p.LoadProgress(STARTUP_STEP, startup.describe()))
            if entry.join is not None:
                join(engine, link, agent)
            link.stats = _stats(engine)
            if engine.kv is not None:
                link.kv_stats = engine.kv.stats
            link.send(p.Ready(p.RankInfo(vocab_size=int(engine.vocab_size),
                                         max_positions=int(engine.max_positions), pid=os.getpid(),
                                         stats=link.stats)))
            code = _loop(engine, link, monitor, agent)
        except BaseException:
            # A broken group: no graceful release (its barrier would wait for the dead peer); the
            # process exit frees this rank's memory. The front hears the reason from rank_main.
            _stop_watchers(monitor, agent)
            raise
        _stop_watchers(monitor, agent)
        if monitor.lost is None and engine.manager.replans == 0 and engine.manager.join is None:
            # importers unmap before owners release: a barrier with the live peers (after a loss the
            # dead rank would never reach it: the process exit frees this rank's memory instead)
            engine.close()
        return code


def _stop_watchers(monitor, agent) -> None:
    if agent is not None:
        agent.stop()
    monitor.stop()


def _test_copy_delay() -> float:
    raw = os.environ.get(TuningEnv.TEST_COPY_DELAY_S, "")
    if not raw:
        return 0.0
    delay = float(raw)
    if not 0.0 <= delay <= 60.0:
        raise ValueError(f"{TuningEnv.TEST_COPY_DELAY_S}={raw!r}: a test hook, must be in [0, 60] seconds")
    log.warning("test hook %s=%g: every copy batch of this rank is delayed", TuningEnv.TEST_COPY_DELAY_S, delay)
    return delay


def _kv_identity(spec: p.RankSpec):
    from ..kv.service import RankIdentity

    return RankIdentity(job=spec.job.replace("/", "-"), group=spec.group, rank=spec.rank, attempt=spec.attempt)


def _chosen(logits, tokens: list[int], top_n: int):
    """Log-probability of each chosen token (rows of ``logits``) and the top-N of each row."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top_n > 0:
        vals, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
        top = [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]
    return chosen, top


def _generate(engine, msg: p.Forward):
    """The cache path: first-step fields, continuations and KV outcomes per sequence."""
    res = engine.generate(msg.sequences, max_new_tokens=msg.max_new_tokens, keep_kv=msg.keep_kv,
                          decode_budget_s=timeouts.DECODE_STEP_BUDGET_S)
    next_ids, logprobs, top, conts, kept = [], [], [], [], []
    for i, o in enumerate(res.outputs):
        lps, tops = _chosen(o.logits, o.tokens, msg.top_n)
        next_ids.append(o.tokens[0])
        logprobs.append(lps[0])
        top.append(tops[0])
        conts.append(p.Continuation(o.tokens[1:], lps[1:], tops[1:]) if len(o.tokens) > 1 else None)
        wanted = msg.keep_kv is not None and msg.keep_kv[i] is not None
        kept.append(p.KvKept(params=o.kv_params.model_dump(mode="json") if o.kv_params else None,
                             error=o.kv_error) if wanted else None)
    return res, next_ids, logprobs, top, conts, kept


def _stats(engine) -> p.RankStats:
    try:
        return engine.stats()
    except Exception as exc:  # noqa: BLE001 - stats must never take the rank down
        return p.RankStats(error=str(exc))


def _loop(engine, link: RankLink, monitor, agent=None) -> int:
    conn = link.conn
    while True:
        monitor.check()  # PeerLost: the group is broken; exit non-zero so the group restarts
        if agent is not None:
            apply_membership(engine, link, agent)
        if not conn.poll(agent.interval_s if agent is not None else timeouts.RANK_HEARTBEAT_S):
            continue
        msg = conn.recv()
        if isinstance(msg, p.Stop):
            return 0
        if not isinstance(msg, p.Forward):
            log.error("unknown message %r from the front (ignored)", type(msg).__name__)
            continue
        if agent is not None:
            apply_membership(engine, link, agent)  # a forward never starts on a stale plan once an epoch is known
        t0 = time.perf_counter()
        link.busy = True
        conts = kept = None
        try:
            scores = None
            if msg.max_new_tokens is None and msg.keep_kv is None:
                res = engine.forward(msg.sequences, msg.score)
                next_ids, logprobs, top = next_tokens(res.logits, msg.top_n)
                scores = _prompt_scores(res, msg)
            else:  # the KV cache path (dispatch never asks it together with prompt scores)
                res, next_ids, logprobs, top, conts, kept = _generate(engine, msg)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the engine
            log.exception("forward of batch %s failed", msg.batch_id)
            link.send(p.StepFailed(msg.batch_id, f"{type(exc).__name__}: {exc}"))
            continue
        finally:
            link.busy = False
        link.stats = _stats(engine)
        link.send(p.StepResult(batch_id=msg.batch_id, next_ids=next_ids, logprobs=logprobs, top=top,
                               compute_s=float(res.compute_s), prefetch_wait_s=float(res.prefetch_wait_s),
                               forward_s=time.perf_counter() - t0, stats=link.stats, prompt=scores,
                               continuations=conts, kv=kept))
