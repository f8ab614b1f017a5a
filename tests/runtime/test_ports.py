"""ports.py: local groups' ports are drawn free and outside the kernel's ephemeral range, where no outgoing
connection can take them between the draw and the bind (real sockets)."""

from __future__ import annotations

import random
import socket

import pytest

from dwdp_runtime import ports


def test_spans_avoid_the_ephemeral_range_and_fall_back_when_it_covers_everything():
    assert ports.draw_spans(5, (32768, 60999)) == [(20000, 32763), (61000, 65531)]
    assert ports.draw_spans(1, (1024, 65535)) == [(20000, 65535)]          # nothing outside: anywhere above the floor
    assert ports.draw_spans(3, (10000, 40000)) == [(40001, 65533)]         # the floor inside the range
    assert ports.draw_spans(2, (49152, 65535)) == [(20000, 49150)]         # IANA's range (macOS, Windows)


def test_a_configured_range_narrows_every_draw_and_a_malformed_one_is_named(monkeypatch):
    assert ports.draw_spans(5, (32768, 60999), (21000, 40000)) == [(21000, 32763)]
    assert ports.draw_spans(1, (32768, 60999), (40000, 50000)) == [(40000, 50000)]   # inside it: ephemeral after all
    with pytest.raises(ports.NoFreePorts, match="does not fit"):
        ports.draw_spans(8, (32768, 60999), (21000, 21003))
    assert ports.configured_range({}) is None
    assert ports.configured_range({ports.PORT_RANGE_ENV: " 21000-21999 "}) == (21000, 21999)
    for bad in ("21000", "a-b", "30000-20000", "80-90", "60000-70000"):
        with pytest.raises(ValueError, match=ports.PORT_RANGE_ENV):
            ports.configured_range({ports.PORT_RANGE_ENV: bad})
    monkeypatch.setenv(ports.PORT_RANGE_ENV, "23000-23099")
    drawn = {ports.free_port() for _ in range(30)} | set(ports.free_port_blocks(5, 4))
    assert all(23000 <= p <= 23099 for p in drawn), drawn


def test_blocks_are_free_now_and_outside_this_hosts_ephemeral_range():
    low, high = ports.ephemeral_range()
    for _ in range(20):
        base = ports.free_port_block(4)
        assert all(not low <= p <= high for p in range(base, base + 4)), (base, low, high)
        held = []
        try:
            for p in range(base, base + 4):   # every port of it binds now
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
        finally:
            for s in held:
                s.close()


def _pick_of(port: int, count: int) -> int:
    """The ``randrange`` value that makes ``free_port_block(count)`` draw ``port`` (its index in the spans' union)."""
    before = 0
    for a, b in ports.draw_spans(count, ports.ephemeral_range(), ports.configured_range()):
        if a <= port <= b:
            return before + port - a
        before += b - a + 1
    raise AssertionError(f"{port} lies in no span")


class _Fixed(random.Random):
    """Draws the same start port every time."""

    def __init__(self, port: int, count: int = 1):
        super().__init__()
        self.pick = _pick_of(port, count)

    def randrange(self, *_):
        return self.pick


def test_a_taken_port_is_skipped_and_a_host_without_free_blocks_is_named():
    base = ports.free_port_block(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base + 1))
        busy.listen()
        with pytest.raises(ports.NoFreePorts, match="no block of 2 free ports"):
            ports.free_port_block(2, tries=3, rng=_Fixed(base, 2))
        other = ports.free_port_block(2)
        assert base + 1 not in (other, other + 1)


class _Sequence(random.Random):
    """Draws the given start ports in turn."""

    def __init__(self, ports_in_turn: list[int], count: int = 1):
        super().__init__()
        self.picks = [_pick_of(p, count) for p in ports_in_turn]

    def randrange(self, *_):
        return self.picks.pop(0)


def test_ports_drawn_together_are_distinct_and_a_draw_that_only_repeats_is_named():
    a, b = ports.free_port_block(1), ports.free_port_block(1)
    while b == a:
        b = ports.free_port_block(1)
    # a repeat is drawn again, not handed out twice
    assert ports.free_ports(2, rng=_Sequence([a, a, a, b])) == [a, b]
    with pytest.raises(ports.NoFreePorts, match="no 2 non-overlapping blocks of 1 free port"):
        ports.free_ports(2, tries=3, rng=_Fixed(a))
    many = ports.free_ports(64)
    low, high = ports.ephemeral_range()
    assert len(set(many)) == 64 and not any(low <= p <= high for p in many)


def test_blocks_drawn_together_never_overlap():
    base = ports.free_port_block(6)
    # a block starting inside the first (base + 2 .. base + 4) is drawn again; one right after it is taken
    picks = [base, base + 2, base + 1, base + 3]
    got = ports.free_port_blocks(2, 3, rng=_Sequence(picks, count=3))
    assert got == [base, base + 3]
    for _ in range(10):
        bases = sorted(ports.free_port_blocks(8, 5))
        assert all(b - a >= 5 for a, b in zip(bases, bases[1:])), bases
