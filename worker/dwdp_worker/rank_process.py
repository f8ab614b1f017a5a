"""One DWDP rank as an OS process: rendezvous → Engine.build → warm-up → serve packed batches.

Started by the front (pod supervisor or local launcher) with ``multiprocessing`` ``spawn``;
talks to it over one duplex ``Connection``. Messages (tuples, first item the kind)::

    rank  → front: ("phase", name)                       starting|rendezvous|loading|warmup
                   ("ready", info)                       vocab_size, max_positions, has_tokenizer, stats
                   ("hb", stats)                         heartbeat, every HEARTBEAT_S while idle
                   ("result", batch_id, payload)         per sequence: next id, its logprob, top-N
                   ("error", batch_id, message)          the forward raised; the rank keeps serving
                   ("fatal", message)                    start-up failed; the process exits 1
    front → rank:  ("forward", batch_id, sequences, top_n)
                   ("stop",)                             leave the group and exit 0

Invariants:
  * The rank never dies on a bad batch: a forward exception is reported as ``error`` for that batch
    only (the front validated the requests; this is the last line of defence).
  * Heartbeats come from the serving loop itself, between forwards: a rank stuck inside a forward
    stops beating, which is what liveness must see.
  * A lost peer (``dwdp_runtime.monitor.PeerMonitor``: another rank of the group, maybe in another
    pod, stopped heart-beating, or the store host died) ends the rank with exit 1 and the reason.
  * The rank dies with its front: ``PR_SET_PDEATHSIG`` (Linux) kills it if the front dies, and a
    closed pipe ends the loop.
  * Greedy selection and log-probabilities are computed here (float32, ``log_softmax`` of the
    last-position logits), so only a few numbers per sequence cross the pipe.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

HEARTBEAT_S = 0.5
# Test hook (never set in production): seconds of delay injected before every copy batch of this
# rank's copy thread (host backend only: ``HostStreams(copy_delay_s=...)``), to prove a slow copy
# thread gives correct answers and shows up as exposed prefetch wait in /metrics.
TEST_COPY_DELAY_ENV = "DWDP_TEST_COPY_DELAY_S"
log = logging.getLogger("dwdp_worker.rank")


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """Everything a rank process needs (picklable; built by the launcher or the pod entrypoint)."""

    model_dir: str
    config: dict                     # DwdpConfig.to_dict()
    rank: int                        # DWDP rank inside the group
    group: int
    global_id: int                   # index of this rank in the front (stable, 0..n-1)
    store_host: str
    store_port: int
    job: str = "dwdp"
    attempt: int = 0
    token: str = ""
    backend: str = "auto"
    device: str | None = None        # "cuda:i" or None (host)
    dtype: str | None = None
    threads: int = 1
    rendezvous_timeout_s: float = 300.0
    warmup_tokens: tuple[int, ...] = (0, 1, 2, 3)
    peer_interval_s: float = 1.0     # PeerMonitor heartbeat period through the group store
    peer_dead_after_s: float = 10.0  # a peer silent this long is lost: this rank exits 1
    env: dict = field(default_factory=dict)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _top(logits, top_n: int) -> dict[str, Any]:
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    nxt = torch.argmax(logits, dim=-1)
    chosen = logp.gather(1, nxt[:, None])[:, 0]
    out: dict[str, Any] = {"next": nxt.tolist(), "logprob": chosen.tolist(), "top": [[] for _ in range(len(nxt))]}
    if top_n > 0:
        k = min(top_n, logp.shape[-1])
        vals, ids = torch.topk(logp, k, dim=-1)
        out["top"] = [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]
    return out


def rank_main(spec: RankSpec, conn) -> None:
    """Process entry point (top level, importable by ``spawn``)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C goes to the front, which stops us in order
    signal.signal(signal.SIGTERM, signal.SIG_IGN)   # likewise: the front drains, then sends ("stop",)
    os.environ.update(spec.env)
    logging.basicConfig(level=os.environ.get("DWDP_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank{spec.global_id} %(levelname)s %(name)s: %(message)s")
    try:
        code = _serve(spec, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        code = 0  # the front is gone; nothing to report to
    except BaseException as exc:  # noqa: BLE001 - reported to the front, then exit non-zero
        msg = f"rank {spec.rank} of group {spec.group}: {type(exc).__name__}: {exc}"
        log.error("%s", msg)
        log.debug("%s", traceback.format_exc())  # operators get the reason; developers can ask for more
        try:
            conn.send(("fatal", msg))
        except Exception:  # noqa: BLE001
            pass
        code = 1
    try:
        conn.close()
    finally:
        os._exit(code)  # skip interpreter teardown of mapped shared memory and stray threads


def _serve(spec: RankSpec, conn) -> int:
    conn.send(("phase", "starting"))
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.monitor import PeerMonitor
    from dwdp_runtime.rendezvous import StoreRendezvous

    from .engine import Engine

    torch.set_num_threads(max(1, spec.threads))
    config = DwdpConfig(**spec.config)
    dtype = getattr(torch, spec.dtype) if spec.dtype else None
    conn.send(("phase", "rendezvous"))
    with StoreRendezvous(host=spec.store_host, port=spec.store_port, rank=spec.rank,
                         world_size=config.dwdp_size, job=spec.job, group=spec.group, attempt=spec.attempt,
                         token=spec.token, timeout_s=spec.rendezvous_timeout_s) as rdzv:
        conn.send(("phase", "loading"))
        engine = Engine.build(model_dir=spec.model_dir, config=config, rank=spec.rank, rendezvous=rdzv,
                              backend=spec.backend, device=spec.device, token=spec.token, dtype=dtype,
                              progress=False, copy_delay_s=_test_copy_delay())
        # Peers in other pods can die without this front noticing: the monitor heart-beats through
        # the group's store (a side thread, off the forward path) and names a lost peer.
        monitor = PeerMonitor(rdzv, interval_s=spec.peer_interval_s, dead_after_s=spec.peer_dead_after_s).start()
        try:
            conn.send(("phase", "warmup"))
            warm = [t % engine.vocab_size for t in spec.warmup_tokens][: max(1, engine.max_positions)]
            engine.forward([warm])
            conn.send(("ready", {"vocab_size": int(engine.vocab_size), "max_positions": int(engine.max_positions),
                                 "has_tokenizer": engine.tokenizer is not None, "pid": os.getpid(),
                                 "stats": _stats(engine)}))
            code = _loop(engine, conn, monitor)
        except BaseException:
            # A broken group: no graceful release (its barrier would wait for the dead peer); the
            # process exit frees this rank's memory. The front hears the reason from rank_main.
            monitor.stop()
            raise
        monitor.stop()
        if monitor.lost is None:
            engine.close()  # importers unmap before owners release: a barrier with the live peers
        return code


def _test_copy_delay() -> float:
    raw = os.environ.get(TEST_COPY_DELAY_ENV, "")
    if not raw:
        return 0.0
    delay = float(raw)
    if not 0.0 <= delay <= 60.0:
        raise ValueError(f"{TEST_COPY_DELAY_ENV}={raw!r}: a test hook, must be in [0, 60] seconds")
    log.warning("test hook %s=%g: every copy batch of this rank is delayed", TEST_COPY_DELAY_ENV, delay)
    return delay


def _stats(engine) -> dict:
    try:
        return {k: v for k, v in engine.stats().items() if isinstance(v, (int, float, str, bool)) or v is None}
    except Exception as exc:  # noqa: BLE001 - stats must never take the rank down
        return {"stats_error": str(exc)}


def _loop(engine, conn, monitor) -> int:
    while True:
        monitor.check()  # PeerLost: the group is broken; exit non-zero so the group restarts
        if not conn.poll(HEARTBEAT_S):
            conn.send(("hb", _stats(engine)))
            continue
        msg = conn.recv()
        kind = msg[0]
        if kind == "stop":
            return 0
        if kind != "forward":
            log.error("unknown message %r from the front (ignored)", kind)
            continue
        _, batch_id, sequences, top_n = msg
        t0 = time.perf_counter()
        try:
            res = engine.forward(sequences)
            payload = _top(res.logits, top_n)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not stop the engine
            log.exception("forward of batch %s failed", batch_id)
            conn.send(("error", batch_id, f"{type(exc).__name__}: {exc}"))
            continue
        payload.update(compute_s=float(res.compute_s), prefetch_wait_s=float(res.prefetch_wait_s),
                       forward_s=time.perf_counter() - t0, stats=_stats(engine))
        conn.send(("result", batch_id, payload))
