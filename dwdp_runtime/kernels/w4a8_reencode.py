"""Where W4A8's per-chunk re-encodings run: in line with the GEMMs, or one chunk ahead on a side stream.

``chunked_forward`` (``w4a8_moe``) walks its chunks of experts (``Step``: a projection and an expert range) in
order and asks a re-encoder for each one's e4m3 weights (``take(i)``), then enqueues the chunk's GEMM and says
so (``done(i)``); ``finish()`` ends the layer.

* ``InlineReencoder`` (the default): each chunk re-encoded on the current stream when taken, into memory of the
  caching allocator, dropped after its GEMM — the re-encoding and the GEMMs take turns.
* ``AheadReencoder`` (``DWDP_W4A8_OVERLAP=on``, CUDA): chunk i + 1 is re-encoded on a side stream while chunk
  i's GEMM runs — memory-bound work beside compute-bound work, as the prefetch's copies run beside the forward
  — into two slots used in turn. Invariants, all as stream-ordered event waits (no host synchronisation, so
  CUDA graphs capture it):
    - the side stream starts after everything the current stream enqueued before the layer (the composite's
      pull, which the current stream waited for; the slots' allocation);
    - chunk i + 1 is written into slot (i + 1) % 2 only after the GEMM of chunk i − 1, which read that slot
      (its ``done`` event; ``take(i)`` enqueues it, after ``done(i − 1)`` was recorded — an event waited on
      before it is recorded would be no wait at all);
    - the current stream waits for chunk i's ``ready`` event before its GEMM, and for the side stream at
      ``finish`` (the capture's join; the slots are freed on the current stream after it);
    - the composite is read by the side stream only before ``ready`` events the current stream waits for, so
      the runtime's end-of-layer event (recorded on the current stream after this) covers those reads too.
  Two slots of the largest chunk are held: ``AHEAD_CHUNKS`` chunks per projection at least, so the first
  chunk, the one not hidden, is small.

The bytes are the same either way (the same kernel on the same inputs); the stream protocol is a small
interface (``StreamOps``) so the CPU tests drive it with a recording fake and check the order of waits.
**Not yet measured on a GPU** (docs/KERNELS.md, W4A8).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from ..contract import Switch, TuningEnv, tuning_choice

#: chunks per projection the side stream is given at least: the first chunk's re-encoding is not hidden
AHEAD_CHUNKS = 4


def overlap_wanted() -> bool:
    """``DWDP_W4A8_OVERLAP`` (``off`` by default: the ahead mode's ≥ 4 chunks per projection cost more than they hide
    where one chunk would do — H100, 2026-12-07, docs/KERNELS.md "W4A8"; an unknown value is an error)."""
    return tuning_choice(TuningEnv.W4A8_OVERLAP, Switch, Switch.OFF) is Switch.ON


@dataclass(frozen=True)
class Step:
    """One chunk: the projection (``gate_up`` / ``down``) and its experts ``[c0, c1)``."""

    projection: str
    c0: int
    c1: int


#: ``encode(step, out)`` → ``(w, s)``: the chunk's re-encoding (``fp4_fp8.fp4_block_fp8`` of its experts), into
#: ``out`` where given, else into new tensors
Encode = Callable[[Step, Any], tuple[torch.Tensor, torch.Tensor]]


class InlineReencoder:
    """Each chunk re-encoded on the current stream when it is taken."""

    def __init__(self, steps: list[Step], encode: Encode) -> None:
        self.steps, self.encode = steps, encode

    def take(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encode(self.steps[i], None)

    def done(self, i: int) -> None:
        return None

    def finish(self) -> None:
        return None


class StreamOps(Protocol):
    """The stream operations ``AheadReencoder`` needs (``CudaStreamOps``; a recording fake in the tests)."""

    def current(self) -> Any: ...
    def side(self) -> Any: ...
    def wait_stream(self, waiter: Any, other: Any) -> None: ...
    def record(self, stream: Any) -> Any: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def on(self, stream: Any) -> Any: ...          # a context manager making ``stream`` current


class CudaStreamOps:
    """``StreamOps`` over torch's CUDA streams and events (one side stream per device, reused)."""

    _sides: dict = {}

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self):
        return torch.cuda.current_stream(self.device)

    def side(self):
        key = self.device.index
        if key not in self._sides:
            self._sides[key] = torch.cuda.Stream(self.device)
        return self._sides[key]

    def wait_stream(self, waiter, other) -> None:
        waiter.wait_stream(other)

    def record(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def on(self, stream):
        return torch.cuda.stream(stream)


@dataclass
class AheadReencoder:
    """Chunk i + 1 re-encoded on a side stream while chunk i's GEMM runs (module docstring's invariants)."""

    steps: list[Step]
    encode: Encode
    slots: list                       # two ``(w_flat uint8, s_flat float32)`` buffers of the largest chunk
    views: Callable[[Step, Any], Any]  # the step's ``(w, s)`` views of a slot
    ops: StreamOps
    _ready: dict = field(default_factory=dict)
    _done: dict = field(default_factory=dict)
    _side: Any = None

    def __post_init__(self) -> None:
        self._side = self.ops.side()
        self.ops.wait_stream(self._side, self.ops.current())
        if self.steps:
            self._enqueue(0)

    def _enqueue(self, i: int) -> None:
        if i >= 2:   # the GEMM that read this slot last
            self.ops.wait_event(self._side, self._done[i - 2])
        with self.ops.on(self._side):
            self.encode(self.steps[i], self.views(self.steps[i], self.slots[i % 2]))
        self._ready[i] = self.ops.record(self._side)

    def take(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i + 1 < len(self.steps):
            self._enqueue(i + 1)
        self.ops.wait_event(self.ops.current(), self._ready[i])
        return self.views(self.steps[i], self.slots[i % 2])

    def done(self, i: int) -> None:
        self._done[i] = self.ops.record(self.ops.current())

    def finish(self) -> None:
        self.ops.wait_stream(self.ops.current(), self._side)
