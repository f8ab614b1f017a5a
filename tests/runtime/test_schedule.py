"""PrefetchSchedule: steady state, aborts, skipped and repeated layers, 2 and 4 slots.

A small simulator applies every ScheduleStep the way the weight manager does and tracks which
position's data each slot holds, so the tests check the *meaning* of the steps: a bound layer's
slot holds that layer's copy, and no copy overwrites a slot before its reader finished.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_runtime.layout import slot_of
from dwdp_runtime.schedule import PrefetchSchedule


class Sim:
    def __init__(self, layers, slots, repeated=()):
        self.s = PrefetchSchedule(num_layers=layers, num_slots=slots, repeated_orders=repeated)
        self.layers, self.slots = layers, slots
        self.content = [None] * slots  # order whose copy was issued last into the slot
        self.reader = [None] * slots  # order currently reading the slot (bound or held)
        self.copies, self.syncs = [], 0

    def apply(self, step):
        if step.synchronize:
            self.syncs += 1
            self.reader = [None] * self.slots
        if step.release is not None:
            self.reader[step.release] = None
        for order in step.prefetch:
            slot = slot_of(order, self.slots)  # the slot whose pool pages the buffer maps under this layer
            assert self.reader[slot] is None, f"copy of {order} overwrites slot {slot} still read by {self.reader[slot]}"
            self.content[slot] = order
            self.copies.append(order)

    def start(self):
        self.apply(self.s.start_forward())

    def bind(self, order):
        self.apply(self.s.bind(order))
        slot = slot_of(order, self.slots)  # the slot whose pool pages the buffer maps under this layer
        assert self.content[slot] == order, f"bound {order} but slot {slot} holds {self.content[slot]}"
        self.reader[slot] = order

    def finish(self, order):
        self.apply(self.s.finish(order))

    def forward(self, orders=None):
        self.start()
        for o in (range(self.layers) if orders is None else orders):
            self.bind(o)
            self.finish(o)


@pytest.mark.parametrize("slots", [2, 4])
def test_steady_state_never_synchronizes(slots):
    sim = Sim(layers=6, slots=slots)
    for _ in range(5):
        sim.forward()
    assert sim.s.num_restarts == 0 and sim.syncs == 0
    # every layer copied exactly once per forward, in order, the first `slots` ahead of time
    assert sim.copies[: 6 * 5] == list(range(6)) * 5
    first = PrefetchSchedule(num_layers=6, num_slots=slots).start_forward()
    assert first.prefetch == list(range(slots)) and not first.synchronize


def test_last_layers_prefetch_the_next_forward():
    s = PrefetchSchedule(num_layers=4, num_slots=2)
    s.start_forward()
    s.bind(0)
    assert s.finish(0).prefetch == [2]
    s.bind(1)
    s.finish(1)
    s.bind(2)
    assert s.finish(2).prefetch == [0]  # next forward's first layer while layer 3 computes
    s.bind(3)
    assert s.finish(3).prefetch == [1]
    step = s.start_forward()
    assert step.prefetch == [] and not step.synchronize


def test_mid_forward_abort_restarts_with_sync():
    sim = Sim(layers=5, slots=2)
    sim.start()
    sim.bind(0)
    sim.finish(0)
    sim.bind(1)  # forward aborted while layer 1 is bound
    sim.forward()
    assert sim.s.num_restarts == 1 and sim.syncs == 1
    sim.forward()
    assert sim.s.num_restarts == 1  # back in steady state


def test_skipped_layer_restarts_and_recovers():
    sim = Sim(layers=5, slots=2)
    sim.forward()
    sim.forward([0, 1, 3, 4])  # layer 2 skipped
    assert sim.s.num_restarts == 1
    sim.forward()
    sim.forward()
    assert sim.s.num_restarts == 1  # the restart realigned positions: later forwards are steady


def test_repeated_layer_reuses_its_slot_without_copy():
    sim = Sim(layers=4, slots=2, repeated=[3])  # MTP draft layer: the last one, run 3 times
    for _ in range(3):
        sim.start()
        for o in range(3):
            sim.bind(o)
            sim.finish(o)
        n = len(sim.copies)
        for _ in range(3):
            sim.bind(3)
            sim.finish(3)
        assert len(sim.copies) == n  # no new copy for the repeats
    assert sim.s.num_restarts == 0 and sim.syncs == 0


def test_undeclared_repeat_restarts():
    sim = Sim(layers=3, slots=2)
    sim.start()
    sim.bind(0)
    sim.finish(0)
    sim.bind(0)
    assert sim.s.num_restarts == 1


def test_defensive_errors():
    s = PrefetchSchedule(num_layers=3, num_slots=2)
    s.start_forward()
    with pytest.raises(RuntimeError, match="without a matching bind"):
        s.finish(0)
    s.bind(0)
    with pytest.raises(RuntimeError, match="without a matching bind"):
        s.finish(1)
    with pytest.raises(ValueError):
        s.bind(7)
    with pytest.raises(ValueError):
        PrefetchSchedule(num_layers=3, num_slots=1)


def test_invalidate_recopies_without_counting_a_restart():
    sim = Sim(layers=3, slots=2)
    sim.forward()
    n = len(sim.copies)
    sim.apply(sim.s.invalidate())
    sim.forward()
    assert sim.s.num_restarts == 0 and len(sim.copies) > n + 2


@settings(max_examples=300, deadline=None)
@given(layers=st.integers(1, 6), slots=st.sampled_from([2, 3, 4]),
       ops=st.lists(st.tuples(st.sampled_from(["start", "bind", "finish"]), st.integers(0, 5)), max_size=60))
def test_random_use_never_reads_stale_or_overwrites_live_slots(layers, slots, ops):
    sim = Sim(layers=layers, slots=slots)
    for kind, o in ops:
        o %= layers
        if kind == "start":
            sim.start()
        elif kind == "bind":
            sim.bind(o)  # asserts the slot holds this layer's copy
        else:
            try:
                sim.finish(o)
            except RuntimeError:
                pass  # finish without bind is refused; the state must stay consistent
