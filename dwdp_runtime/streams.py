"""Two queues and their events: the compute stream, the copy stream, RAW/WAR ordering between them.

The weight manager talks to this interface only, so the same ordering logic runs on CUDA streams
(``dwdp_runtime.cuda_streams.CudaStreams``) and on the host (``HostStreams``)::

  compute: --wait(prefetch[0])--> [MoE L3] rec(consume[0]) [attn] --wait(prefetch[1])--> [MoE L4] rec(consume[1])
  copy:    --wait(consume[0])--> [copy L5] rec(prefetch[0]) --wait(consume[1])--> [copy L6] rec(prefetch[1])

Semantics (CUDA's): ``record_*(ev)`` marks "everything enqueued so far on that stream";
``wait_*(ev)`` makes later work on that stream wait for the *latest* record of ``ev``; a new
event counts as already signalled (so the first prefetch into a slot never stalls).

Host implementation: the compute stream is the calling thread (its work is synchronous, so a
record on it completes at once); the copy stream is one worker thread running a FIFO of ops
(wait, copy, signal). ``ctypes.memmove`` releases the GIL, so copies overlap torch compute.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, Sequence

from .contract import DEFAULT_TRANSFER

CopyTriple = tuple[int, int, int]  # (dst address, src address, nbytes)


class CopyStreamError(RuntimeError):
    """The copy stream failed or stalled; the forward cannot trust its weights."""


class Streams(ABC):
    """Copy/compute queues. ``compile`` runs at setup (no allocation later), ``enqueue_copies`` per layer."""

    transfer: str = DEFAULT_TRANSFER
    #: whether ``enqueue_copies`` may run inside a CUDA-graph capture (``WeightManager.capture``)
    capturable: bool = True

    @abstractmethod
    def new_event(self) -> Any: ...

    @abstractmethod
    def record_compute(self, event: Any) -> None: ...

    @abstractmethod
    def wait_compute(self, event: Any) -> None: ...

    @abstractmethod
    def record_copy(self, event: Any) -> None: ...

    @abstractmethod
    def wait_copy(self, event: Any) -> None: ...

    @abstractmethod
    def compile(self, copies: Sequence[CopyTriple]) -> Any:
        """Turn absolute copies into whatever ``enqueue_copies`` submits fastest (cached per layer)."""

    @abstractmethod
    def enqueue_copies(self, compiled: Any) -> None: ...

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for all work on both streams (device-wide; only after a schedule restart)."""

    def copy_now(self, copies: Sequence[CopyTriple]) -> None:
        """Setup-time copies (edge fill), completed on return."""
        self.enqueue_copies(self.compile(copies))
        self.synchronize()

    def close(self) -> None:
        pass


class HostEvent:
    __slots__ = ("recorded", "completed", "cond")

    def __init__(self) -> None:
        self.recorded = 0
        self.completed = 0
        self.cond = threading.Condition()

    def _complete(self, target: int) -> None:
        with self.cond:
            if target > self.completed:
                self.completed = target
            self.cond.notify_all()

    def _wait(self, target: int, timeout: float | None, error: list) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.completed >= target or error, timeout)


class HostStreams(Streams):
    """Compute = the caller's thread; copy = a worker thread with a FIFO (see module docstring).

    ``copy_delay_s`` injects a delay before every copy batch (tests prove the events order things);
    ``stall_timeout_s`` bounds how long compute waits for a copy before raising CopyStreamError.
    """

    def __init__(self, *, transfer: str = DEFAULT_TRANSFER, copy_delay_s: float = 0.0,
                 stall_timeout_s: float = 120.0):
        self.transfer = transfer
        self.copy_delay_s = copy_delay_s
        self.stall_timeout_s = stall_timeout_s
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._error: list[BaseException] = []
        self._lock = threading.Lock()
        self.stats = {"copy_bytes": 0, "copy_batches": 0, "wait_s": 0.0, "synchronize": 0}
        self._thread = threading.Thread(target=self._run, name="dwdp-copy-stream", daemon=True)
        self._closed = False
        self._thread.start()

    # -- copy thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        memmove = ctypes.memmove
        while True:
            op = self._ops.get()
            kind = op[0]
            try:
                if kind == "stop":
                    return
                if self._error:
                    if kind == "signal":
                        op[1]._complete(op[2])
                    continue
                if kind == "copy":
                    if self.copy_delay_s:
                        time.sleep(self.copy_delay_s)
                    for dst, src, n in op[1]:
                        memmove(dst, src, n)
                    self.stats["copy_bytes"] += op[2]
                    self.stats["copy_batches"] += 1
                elif kind == "wait":
                    ev, target = op[1], op[2]
                    while not ev._wait(target, 1.0, self._error):
                        pass
                elif kind == "signal":
                    op[1]._complete(op[2])
            except BaseException as exc:  # surfaced to the compute side, never swallowed
                self._error.append(exc)
                if kind == "signal":
                    op[1]._complete(op[2])

    def _check(self) -> None:
        if self._error:
            raise CopyStreamError(f"copy stream failed: {self._error[0]!r}") from self._error[0]
        if self._closed:
            raise CopyStreamError("copy stream is closed")

    # -- interface -----------------------------------------------------------------------------
    def new_event(self) -> HostEvent:
        return HostEvent()

    def record_compute(self, event: HostEvent) -> None:
        with event.cond:
            event.recorded += 1
            event.completed = event.recorded
            event.cond.notify_all()

    def wait_compute(self, event: HostEvent) -> None:
        target = event.recorded
        if event.completed >= target:
            self._check()
            return
        t0 = time.perf_counter()
        ok = event._wait(target, self.stall_timeout_s, self._error)
        self.stats["wait_s"] += time.perf_counter() - t0
        self._check()
        if not ok:
            raise CopyStreamError(f"copy stream stalled: no progress for {self.stall_timeout_s:.0f} s")

    def record_copy(self, event: HostEvent) -> None:
        self._check()
        with event.cond:
            event.recorded += 1
            target = event.recorded
        self._ops.put(("signal", event, target))

    def wait_copy(self, event: HostEvent) -> None:
        self._check()
        self._ops.put(("wait", event, event.recorded))

    def compile(self, copies: Sequence[CopyTriple]) -> tuple:
        batch = tuple((int(d), int(s), int(n)) for d, s, n in copies)
        return batch, sum(n for _, _, n in batch)

    def enqueue_copies(self, compiled: tuple) -> None:
        self._check()
        self._ops.put(("copy", compiled[0], compiled[1]))

    def synchronize(self) -> None:
        self.stats["synchronize"] += 1
        ev = HostEvent()
        self.record_copy(ev)
        self.wait_compute(ev)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._ops.put(("stop",))
            self._thread.join(timeout=10)
