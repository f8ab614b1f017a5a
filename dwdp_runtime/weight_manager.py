"""WeightManager: applies the PrefetchSchedule on the streams, with one RAW and one WAR event per slot.

  compute: --wait(prefetch[s])--> [MoE layer] rec(consume[s]) [attention] --wait(prefetch[s'])--> …
  copy:    --wait(consume[s])--> [copy next layer into slot s] rec(prefetch[s]) …

  * ``prefetch[s]`` (RAW): recorded on the copy stream after a layer's copies into slot s; the
    compute stream waits on it in ``wait_and_bind`` before the MoE kernels read the slot.
  * ``consume[s]`` (WAR): recorded on the compute stream in ``finish_layer`` — AFTER the MoE
    kernels were enqueued. Recording it at bind would place it before the kernels and let the copy
    stream overwrite pages a kernel is still reading. Events start signalled so the first copy
    into a slot does not stall.
  * A ScheduleStep is applied in field order: synchronize (only after a restart), release (record
    consume), prefetch (wait consume, copy, record prefetch).
Steady state: no synchronize, no allocation, only remote bytes copied (the plan is precompiled).

CUDA-graph capture (``capture()``, entered inside ``torch.cuda.graph``; ``worker/dwdp_worker/prefill_graphs``):
  * a capturing stream may only wait on events recorded in the same capture (CUDA refuses an outside event:
    cudaErrorStreamCaptureIsolation), so inside ``capture()`` a wait on an event recorded before it is
    skipped and counted (``capture_skipped_waits``). That is safe because every replay is preceded by
    ``join_copies()`` (the compute stream waits for all copy-stream work so far) and a graph launch starts
    after all earlier work of its stream;
  * at entry the copy stream waits on a fork event recorded in the capture (it joins the capture: its
    copies become graph nodes, not eager work); at exit the compute stream waits on a join event recorded
    on the copy stream (CUDA refuses to end a capture with an unjoined stream). The graph's tail thereby
    includes the next forward's first-layer copies, so the slots are filled when the replay completes;
  * a capture starts only at a forward boundary (``PrefetchSchedule.mid_sequence``): there every steady
    forward issues the same copies, so one graph stands for all of them; the host schedule advances
    through the captured forward exactly as through an eager one and is left at the same boundary.
  * an event recorded inside a capture stands for graph nodes, and CUDA refuses an eager wait on it
    (CUDA_ERROR_INVALID_VALUE, measured on H200): before the first eager record or wait after a capture,
    every event the capture recorded is recorded again, eagerly, on the stream it was recorded on. That marks
    all work enqueued so far, which is conservative and enough: what a later replay does is ordered by the
    compute stream (a replay is complete before later compute work; every eager copy waits on a consume event
    recorded eagerly after it).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Hashable, Iterator, Sequence

from .schedule import PrefetchSchedule, ScheduleStep
from .streams import Streams
from .weight_buffer import WeightBuffer


class WeightManager:
    def __init__(self, *, buffer: WeightBuffer, streams: Streams, layers: Sequence[Hashable],
                 num_slots: int, repeated: Sequence[Hashable] = ()):
        self.buffer, self.streams = buffer, streams
        self.layers = list(layers)
        self._order = {layer: i for i, layer in enumerate(self.layers)}
        self.schedule = PrefetchSchedule(num_layers=len(self.layers), num_slots=num_slots,
                                         repeated_orders=[self._order[x] for x in repeated])
        self._prefetch_events = [streams.new_event() for _ in range(num_slots)]
        self._consume_events = [streams.new_event() for _ in range(num_slots)]
        self._compiled = [buffer.compiled_copies(layer) for layer in self.layers]
        self._remote = [buffer.remote_bytes_per_layer[layer] for layer in self.layers]
        self._fork_event, self._join_event = streams.new_event(), streams.new_event()
        self._captured: dict[int, tuple[Any, Any]] | None = None  # id → (event, record call) in the capture under way
        self._recapture: dict[int, tuple[Any, Any]] = {}  # recorded by the last capture, to re-record eagerly
        self.stats = {"prefetch_bytes": 0, "prefetch_layers": 0, "synchronize": 0, "bind_wait_s": 0.0,
                      "captures": 0, "capture_skipped_waits": 0}

    @property
    def num_restarts(self) -> int:
        return self.schedule.num_restarts

    def reload_copies(self) -> None:
        """Take the buffer's copy lists again (after ``WeightBuffer.replan``) and invalidate the schedule:
        the next forward re-copies every layer from the new sources. Call at a forward boundary, with the
        copy stream quiesced (``DwdpManager.set_membership``)."""
        if self.capturing:
            raise RuntimeError("cannot re-plan inside a CUDA-graph capture")
        self._compiled = [self.buffer.compiled_copies(layer) for layer in self.layers]
        self._remote = [self.buffer.remote_bytes_per_layer[layer] for layer in self.layers]
        self.invalidate()

    def order_of(self, layer: Hashable) -> int:
        try:
            return self._order[layer]
        except KeyError:
            raise KeyError(f"layer {layer!r} was not registered with DWDP (registered: {self.layers})") from None

    def start_forward(self) -> None:
        self._apply(self.schedule.start_forward())

    def wait_and_bind(self, layer: Hashable) -> dict[str, Any]:
        order = self.order_of(layer)
        self._apply(self.schedule.bind(order))
        t0 = time.perf_counter()
        self._wait(self.streams.wait_compute, self._prefetch_events[self.schedule.slot(order)])
        self.stats["bind_wait_s"] += time.perf_counter() - t0
        return self.buffer.tensors(layer)

    def finish_layer(self, layer: Hashable) -> None:
        self._apply(self.schedule.finish(self.order_of(layer)))

    def invalidate(self) -> None:
        self._apply(self.schedule.invalidate())

    # -- CUDA-graph capture (module docstring) ---------------------------------------------------------
    @property
    def capturing(self) -> bool:
        return self._captured is not None

    def join_copies(self) -> None:
        """Make later compute-stream work wait for every copy enqueued so far; call it before each capture and each
        replay (it also re-records, eagerly, the events of the last capture: module docstring)."""
        if self.capturing:
            raise RuntimeError("join_copies() inside a capture: call it before the graph is captured or replayed")
        self._refresh()
        self.streams.record_copy(self._join_event)
        self.streams.wait_compute(self._join_event)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """The DWDP side of one captured forward; enter it inside ``torch.cuda.graph`` (module docstring).

        Refused (RuntimeError, before anything is enqueued) mid-sequence, inside another capture, and on a
        copy stream whose copies cannot be captured (``Streams.capturable``: ``batched``)."""
        if self.capturing:
            raise RuntimeError("a DWDP capture is already under way")
        if not self.streams.capturable:
            raise RuntimeError(f"transfer {self.streams.transfer!r} cannot be captured in a CUDA graph")
        if self.schedule.mid_sequence():
            raise RuntimeError("capture() mid-sequence: a forward is under way; capture at a forward boundary")
        # events of an earlier capture not yet re-recorded (no join_copies since) cannot be re-recorded here,
        # inside torch's capture: they stay due, beside this capture's own
        leftover, self._captured = self._recapture, {}
        try:
            self._record(self.streams.record_compute, self._fork_event)
            self._wait(self.streams.wait_copy, self._fork_event)  # the copy stream joins the capture
            try:
                yield
            except BaseException:
                with contextlib.suppress(Exception):  # the capture is lost anyway; keep the first error
                    self._join_copy_stream()
                raise
            self._join_copy_stream()
            self.stats["captures"] += 1
        finally:
            self._recapture, self._captured = {**leftover, **self._captured}, None

    def _join_copy_stream(self) -> None:
        self._record(self.streams.record_copy, self._join_event)
        self._wait(self.streams.wait_compute, self._join_event)

    def _record(self, record, event) -> None:
        if self._captured is not None:
            self._captured[id(event)] = (event, record)
        elif self._recapture:
            self._refresh()
        record(event)

    def _wait(self, wait, event) -> None:
        if self._captured is not None:
            if id(event) not in self._captured:
                self.stats["capture_skipped_waits"] += 1  # recorded before the capture: see module docstring
                return
        elif self._recapture:
            self._refresh()
        wait(event)

    def _refresh(self) -> None:
        """Re-record, eagerly, the events the last capture recorded (module docstring)."""
        events, self._recapture = self._recapture, {}
        for event, record in events.values():
            record(event)

    def _apply(self, step: ScheduleStep) -> None:
        if step.synchronize:
            if self.capturing:  # a device-wide wait cannot be captured; the caller abandons the capture
                raise RuntimeError("the prefetch schedule restarted during a CUDA-graph capture")
            self.stats["synchronize"] += 1
            self.streams.synchronize()
        if step.release is not None:
            self._record(self.streams.record_compute, self._consume_events[step.release])
        for order in step.prefetch:
            slot = self.schedule.slot(order)
            self._wait(self.streams.wait_copy, self._consume_events[slot])
            self.streams.enqueue_copies(self._compiled[order])
            self._record(self.streams.record_copy, self._prefetch_events[slot])
            self.stats["prefetch_bytes"] += self._remote[order]
            self.stats["prefetch_layers"] += 1
