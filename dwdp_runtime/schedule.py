"""PrefetchSchedule: which layer's remote experts to copy into which slot, and when. Host-only.

No device API here: every state change returns a ``ScheduleStep(synchronize, release, prefetch)``
that the weight manager applies in field order on the right streams:

  1. ``synchronize`` — wait for the whole device (only after an out-of-order use: a slot may still
     be read by a kernel of the abandoned sequence or written by an orphaned copy);
  2. ``release``     — record the consume (WAR) event of this slot on the compute stream *now*,
     i.e. after the MoE kernels that read it were enqueued;
  3. ``prefetch``    — MoE orders whose copies to enqueue now (each waits on its slot's consume event).

Positions count across forwards: position p is MoE order ``p mod L`` (L = MoE layers), its slot is
``layout.slot_of(order, num_slots)`` (``order mod num_slots``, the rule the pool is built by). The
last layers of one forward therefore prefetch the first layers of the next forward, and a
steady-state ``start_forward`` issues nothing new and never synchronizes.

Invariants:
  * a slot is owned by at most one issued-but-unfinished position;
  * ``bind(order)`` returns only after the copy for that position was issued (else RuntimeError);
  * ``finish`` without a matching ``bind`` raises RuntimeError;
  * any out-of-order use (skipped layer, repeated layer not declared repeated, a forward aborted
    mid-way) restarts the sequence with ``synchronize=True`` and increments ``num_restarts`` — the
    number the health probe reports;
  * a layer declared in ``repeated_orders`` (MTP draft layers) that is bound again right after it
    finished reuses its slot without a new copy; its slot is released at the next other bind or
    at ``start_forward``.
"""

from __future__ import annotations

import logging
from typing import Iterable, NamedTuple

from .layout import slot_of

log = logging.getLogger(__name__)


class ScheduleStep(NamedTuple):
    synchronize: bool
    release: int | None
    prefetch: list[int]


class PrefetchSchedule:
    def __init__(self, *, num_layers: int, num_slots: int, repeated_orders: Iterable[int] = ()):
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers}: a DWDP model needs at least one MoE layer")
        if num_slots < 2:
            raise ValueError(f"num_slots={num_slots}: at least 2 prefetch slots are required")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self._repeated = frozenset(repeated_orders)
        bad = [o for o in self._repeated if not 0 <= o < num_layers]
        if bad:
            raise ValueError(f"repeated_orders {bad} outside [0, {num_layers})")
        self._next_bind = 0  # the position expected at the next bind
        self._issued = 0  # positions whose copies were issued
        self._slot_owner: list[int | None] = [None] * num_slots
        self._bound: int | None = None  # bound, not finished
        self._held: int | None = None  # a repeated layer finished but still owning its slot
        self.num_restarts = 0

    def slot(self, order: int) -> int:
        """The slot of MoE order ``order``: ``layout.slot_of``, the same rule the pool is built by."""
        return slot_of(order, self.num_slots)

    def mid_sequence(self) -> bool:
        """True between a forward's first bind and its last finish (a layer still bound, or the next bind not
        the forward's first layer). At a boundary the issued copies are a function of the layer count and slot
        count alone (``_issue`` is greedy and a restart re-issues the same prefix), so every steady forward
        issues the same copies in the same places: what lets one captured CUDA graph stand for all of them.
        A repeated layer held over the boundary is no obstacle: ``start_forward`` releases it the same way
        in every forward."""
        return self._bound is not None or self._next_bind % self.num_layers != 0

    # -- state transitions ---------------------------------------------------------------------
    def start_forward(self) -> ScheduleStep:
        if self._bound is None and self._next_bind % self.num_layers == 0:
            release = self._release_held()
            return ScheduleStep(False, release, self._issue())
        return self._restart(0, reason="forward started while the previous one was mid-sequence")

    def bind(self, order: int) -> ScheduleStep:
        self._check_order(order)
        if self._bound is None and self._held is not None and order == self._held % self.num_layers:
            self._bound = self._held  # repeated layer: its data is still in the slot
            return ScheduleStep(False, None, [])
        if self._bound is not None or self._next_bind % self.num_layers != order:
            expected = self._next_bind % self.num_layers
            step = self._restart(order, reason=f"bind(order={order}) while order {expected} was expected"
                                 + (" and another layer is still bound" if self._bound is not None else ""))
        else:
            release = self._release_held()
            step = ScheduleStep(False, release, self._issue())  # [] unless a slot just freed up
        if self._issued <= self._next_bind:
            raise RuntimeError(f"bind(order={order}) before its copy was issued: the schedule is corrupt")
        self._bound = self._next_bind
        return step

    def finish(self, order: int) -> ScheduleStep:
        self._check_order(order)
        if self._bound is None or self._bound % self.num_layers != order:
            raise RuntimeError(f"finish(order={order}) without a matching bind (bound: "
                               f"{None if self._bound is None else self._bound % self.num_layers})")
        pos, self._bound = self._bound, None
        self._next_bind = max(self._next_bind, pos + 1)
        if order in self._repeated:
            self._held = pos
            return ScheduleStep(False, None, [])
        slot = self.slot(order)
        self._slot_owner[slot] = None
        return ScheduleStep(False, slot, self._issue())

    def invalidate(self) -> ScheduleStep:
        """Drop all issued prefetches (weights changed): the next use re-copies everything."""
        return self._restart(self._next_bind % self.num_layers, reason="invalidated", count=False)

    # -- helpers ---------------------------------------------------------------------------------
    def _check_order(self, order: int) -> None:
        if not 0 <= order < self.num_layers:
            raise ValueError(f"MoE order {order} outside [0, {self.num_layers})")

    def _issue(self) -> list[int]:
        orders = []
        while True:
            order = self._issued % self.num_layers
            slot = self.slot(order)
            if self._slot_owner[slot] is not None:
                return orders
            self._slot_owner[slot] = self._issued
            self._issued += 1
            orders.append(order)

    def _release_held(self) -> int | None:
        if self._held is None:
            return None
        slot = self.slot(self._held % self.num_layers)
        self._held = None
        self._slot_owner[slot] = None
        return slot

    def _restart(self, order: int, *, reason: str, count: bool = True) -> ScheduleStep:
        busy = self._bound is not None or self._held is not None or any(o is not None for o in self._slot_owner)
        base = (self._next_bind // self.num_layers + 1) * self.num_layers + order
        self._next_bind = self._issued = base
        self._slot_owner = [None] * self.num_slots
        self._bound = self._held = None
        if count:
            self.num_restarts += 1
            n = self.num_restarts
            if n & (n - 1) == 0:  # log at powers of two: no log flood on a pathological caller
                log.warning("prefetch schedule restarted (%s); restarts so far: %d", reason, n)
        return ScheduleStep(busy, None, self._issue())
