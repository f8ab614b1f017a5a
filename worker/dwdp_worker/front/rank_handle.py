"""The front's side of one rank process: spawn it, read its messages, send it steps, kill it, describe it.

Threads: one reader thread per rank only receives from the pipe and posts each message (and finally
the process exit) onto the front's event loop with ``call_soon_threadsafe``; every state change
happens on the loop thread (``RankHandle.apply``), so the handle needs no lock.

Invariants:
  * ``batch`` is the only record of the step a rank holds; a rank holds at most one at a time.
  * ``heartbeat_age`` counts from the last message of any kind; the rank beats from a thread every
    ``timeouts.RANK_HEARTBEAT_S`` even inside a forward, so a ready rank's age beyond the heartbeat
    timeout means a frozen or dead process — busy or not.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from dwdp_runtime.contract import RankStart, TuningEnv, tuning_choice

from ..rank import protocol as p
from ..rank import timeouts
from ..rank.process import rank_main

log = logging.getLogger("dwdp_worker.front.rank_handle")


@dataclass
class InFlight:
    """The step a rank holds: its id, the jobs it carries (in sequence order), when it was sent."""

    batch_id: int
    jobs: list
    sent_at: float


#: what every rank imports before its first useful line: torch and `transformers`' model machinery, seconds of CPU
#: in a fresh interpreter. The fork server imports them once and each rank is forked from it. None of them creates
#: a CUDA context (a process forked after one exists could not use CUDA), so a forked rank creates its own, as a
#: spawned one does; its environment comes with its spec (``rank_main``), not from the fork server's.
RANK_PRELOAD = ("torch", "transformers.modeling_utils", "dwdp_worker.rank.process")


def rank_context(environ=None):
    """The multiprocessing context rank processes start from (``DWDP_RANK_START``, default the fork server);
    ``ValueError`` naming the choices for an unknown value."""
    how = tuning_choice(TuningEnv.RANK_START, RankStart, RankStart.FORKSERVER, environ)
    ctx = mp.get_context(how.value)
    if how is RankStart.FORKSERVER:
        ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


class RankHandle:
    def __init__(self, spec: p.RankSpec):
        self.spec = spec
        self.proc: Any = None
        self.conn: Any = None
        self.phase = p.RankPhase.SPAWNED
        self.info: p.RankInfo | None = None
        self.stats = p.RankStats()
        self.progress: str | None = None
        self.last_msg = time.monotonic()
        self.batch: InFlight | None = None
        self.dispatched = 0
        self.front_forwards = 0
        self.compute_s = 0.0
        self.prefetch_wait_s = 0.0
        self.last_forward_end: float | None = None
        self.fatal: str | None = None
        self.peer_lost: str | None = None
        self.exitcode: int | None = None
        self.dead = False
        self.retired = False  # dead, and its elastic group serves on without it (issue #30)
        self.respawns = 0     # processes started before this one for the same rank (a replacement: > 0)
        self.rejoining = False  # a replacement not ready yet: its group serves without its rank meanwhile
        self.reloaded: list[int] = []  # experts this rank reloaded from the checkpoint (on_uncovered=reload)
        self.stopping = False

    @property
    def gid(self) -> int:
        return self.spec.global_id

    @property
    def ready(self) -> bool:
        return self.phase == p.RankPhase.READY and not self.dead and not self.stopping

    def heartbeat_age(self, now: float) -> float:
        return now - self.last_msg

    def describe(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"rank {self.gid} (group {self.spec.group}, DWDP rank {self.spec.rank}, pid {pid})"

    # -- process ------------------------------------------------------------------------------------------
    def replacement(self) -> "RankHandle":
        """A handle for a new process of this rank (an elastic group's lost rank, restarted to rejoin)."""
        h = RankHandle(self.spec)
        h.respawns, h.rejoining = self.respawns + 1, True
        return h

    def spawn(self, post: Callable[..., None], on_message: Callable, on_exit: Callable) -> None:
        """Start the process and its reader thread; messages and the exit arrive through ``post``."""
        ctx = rank_context()
        parent, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=rank_main, args=(self.spec, child), name=f"dwdp-rank{self.gid}",
                                daemon=False)
        self.proc.start()
        child.close()  # the child holds its own copy; ours would hide EOF when it dies
        self.conn = parent
        self.last_msg = time.monotonic()
        threading.Thread(target=self._read, args=(post, on_message, on_exit), name=f"dwdp-reader{self.gid}",
                         daemon=True).start()

    def _read(self, post, on_message, on_exit) -> None:
        try:
            while True:
                post(on_message, self, self.conn.recv())
        except (EOFError, OSError):
            pass
        except Exception as exc:  # noqa: BLE001 - an unpicklable message is a protocol bug
            log.error("reader of %s: %s", self.describe(), exc)
        self.proc.join(timeout=timeouts.REAP_S)
        post(on_exit, self, self.proc.exitcode)

    def send(self, msg: p.FrontMessage) -> None:
        self.conn.send(msg)

    def kill(self) -> None:
        """SIGKILL (works on a stopped process too); the reader thread then reports the exit."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()

    # -- messages (loop thread) ---------------------------------------------------------------------------
    def apply(self, msg: p.RankMessage, now: float) -> None:
        """Record what a state message says (results and errors are the dispatcher's)."""
        self.last_msg = now
        if isinstance(msg, p.PhaseChanged):
            self.phase = msg.phase
        elif isinstance(msg, p.Ready):
            self.info, self.stats = msg.info, msg.info.stats
            self.last_forward_end = now  # the warm-up forward just finished
            self.phase = p.RankPhase.READY
            self.progress = None
            self.rejoining = False
        elif isinstance(msg, p.Heartbeat):
            self.stats = msg.stats
        elif isinstance(msg, p.LoadProgress):
            self.progress = f"{msg.step}: {msg.detail}"
        elif isinstance(msg, p.StepResult):
            self.stats = msg.stats
            self.front_forwards += 1
            self.last_forward_end = now
            self.compute_s += msg.compute_s
            self.prefetch_wait_s += msg.prefetch_wait_s
        elif isinstance(msg, p.ExpertsReloaded):
            self.reloaded = sorted({*self.reloaded, *msg.experts})
        elif isinstance(msg, p.PeerLost):
            self.peer_lost = msg.message
        elif isinstance(msg, p.Fatal):
            self.fatal = msg.message

    def take_batch(self, batch_id: int) -> InFlight | None:
        """The step the rank answered, which it no longer holds; ``None`` if it holds another."""
        if self.batch is None or self.batch.batch_id != batch_id:
            return None
        held, self.batch = self.batch, None
        return held

    # -- view ---------------------------------------------------------------------------------------------
    def snapshot(self, now: float) -> dict[str, Any]:
        s = self.stats
        return {
            "global_id": self.gid, "group": self.spec.group, "rank": self.spec.rank,
            "pid": self.proc.pid if self.proc else None, "device": self.spec.device or "cpu",
            "phase": str(self.phase), "alive": not self.dead, "retired": self.retired, "exitcode": self.exitcode,
            "rejoining": self.rejoining, "respawns": self.respawns,
            "reloaded_experts": list(self.reloaded),
            "busy": self.batch is not None,
            "busy_s": round(now - self.batch.sent_at, 3) if self.batch else None,
            "heartbeat_age_s": round(self.heartbeat_age(now), 3),
            "progress": self.progress,
            "forwards": int(s.forwards or self.front_forwards),
            "prefetch_restarts": s.prefetch_restarts,
            "prefetch_bytes": s.prefetch_bytes,
            "remote_bytes_per_forward": s.remote_bytes_per_forward,
            "backend": s.backend,
            "kv": s.kv.as_dict() if s.kv is not None else None,
            "prefill_graphs": dataclasses.asdict(s.graphs) if s.graphs is not None else None,
            "compute_s": round(self.compute_s, 6), "prefetch_wait_s": round(self.prefetch_wait_s, 6),
            "sequences_served": self.dispatched,
            "last_forward_age_s": (round(now - self.last_forward_end, 3)
                                   if self.last_forward_end is not None else None),
        }
