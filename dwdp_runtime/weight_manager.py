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
"""

from __future__ import annotations

import time
from typing import Any, Hashable, Sequence

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
        self.stats = {"prefetch_bytes": 0, "prefetch_layers": 0, "synchronize": 0, "bind_wait_s": 0.0}

    @property
    def num_restarts(self) -> int:
        return self.schedule.num_restarts

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
        self.streams.wait_compute(self._prefetch_events[self.schedule.slot(order)])
        self.stats["bind_wait_s"] += time.perf_counter() - t0
        return self.buffer.tensors(layer)

    def finish_layer(self, layer: Hashable) -> None:
        self._apply(self.schedule.finish(self.order_of(layer)))

    def invalidate(self) -> None:
        self._apply(self.schedule.invalidate())

    def _apply(self, step: ScheduleStep) -> None:
        if step.synchronize:
            self.stats["synchronize"] += 1
            self.streams.synchronize()
        if step.release is not None:
            self.streams.record_compute(self._consume_events[step.release])
        for order in step.prefetch:
            slot = self.schedule.slot(order)
            self.streams.wait_copy(self._consume_events[slot])
            self.streams.enqueue_copies(self._compiled[order])
            self.streams.record_copy(self._prefetch_events[slot])
            self.stats["prefetch_bytes"] += self._remote[order]
            self.stats["prefetch_layers"] += 1
