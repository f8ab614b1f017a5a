"""Ports for a local group (its rendezvous store, the elastic standby stores, a front's HTTP port), drawn where the
kernel does not hand out ports of its own.

Invariant: a drawn port (or block of ports) was free when drawn and lies outside the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768–60999 by default). Why: a port is drawn, released, and bound
again seconds later by the process that serves on it (a rank importing torch first). Inside the ephemeral range
any outgoing connection on the host can take it in between as its source port, for as long as that connection
lives: seen on CI (2026-12-07), a TCPStore refused with EADDRINUSE for its whole 60 s rendezvous timeout while
the test control plane's long-lived connections were open. Outside that range only another explicit bind can take
it. Where the range leaves no room (a host that made almost every port ephemeral), ports are drawn anywhere above
``PORT_FLOOR``. ``DWDP_PORT_RANGE=LOW-HIGH`` narrows every draw to that range (``PORT_RANGE_ENV`` says why).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

#: the lowest port drawn: above the well-known and most registered services' ports
PORT_FLOOR = 20000
#: the highest TCP port
PORT_CEILING = 65535
#: Linux's default ephemeral range, where /proc cannot be read
EPHEMERAL_DEFAULT = (32768, 60999)
#: where the kernel states its ephemeral range
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: blocks tried before giving up (each a random draw, checked by binding every port of it)
DRAW_TRIES = 64
#: ``LOW-HIGH`` (inclusive): draw only there. Why: a port is checked free when drawn and bound later, so two
#: processes drawing on one host at once (two local launchers, two test workers) can draw the same port in between;
#: disjoint ranges cannot. Still kept outside the ephemeral range where the range leaves room.
PORT_RANGE_ENV = "DWDP_PORT_RANGE"


class NoFreePorts(OSError):
    """No block of free ports was found in ``DRAW_TRIES`` draws."""


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive), or Linux's default where it cannot be read."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def configured_range(environ=os.environ) -> tuple[int, int] | None:
    """``DWDP_PORT_RANGE`` as ``(low, high)``, or ``None`` when unset; ``ValueError`` naming the fix when malformed."""
    raw = environ.get(PORT_RANGE_ENV, "").strip()
    if not raw:
        return None
    try:
        low, high = (int(x) for x in raw.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={raw!r}: expected LOW-HIGH, e.g. 20000-24999") from None
    if not 1024 <= low <= high <= PORT_CEILING:
        raise ValueError(f"{PORT_RANGE_ENV}={raw!r}: expected 1024 <= LOW <= HIGH <= {PORT_CEILING}")
    return low, high


def draw_spans(count: int, ephemeral: tuple[int, int], within: tuple[int, int] | None = None
               ) -> list[tuple[int, int]]:
    """The inclusive ranges a block of ``count`` ports may start in: above ``PORT_FLOOR`` (or inside ``within``),
    the whole block outside ``ephemeral``; anywhere there where nothing is outside it."""
    floor, ceiling = within or (PORT_FLOOR, PORT_CEILING)
    low, high = ephemeral
    last_start = ceiling - count + 1
    spans = [(floor, min(low - count, last_start)), (max(high + 1, floor), last_start)]
    spans = [(a, b) for a, b in spans if b >= a]
    if spans:
        return spans
    if last_start < floor:
        raise NoFreePorts(f"a block of {count} ports does not fit in {floor}-{ceiling}")
    return [(floor, last_start)]


def _draw(spans: list[tuple[int, int]], rng: random.Random) -> int:
    """A start port uniform over the spans' union."""
    sizes = [b - a + 1 for a, b in spans]
    pick = rng.randrange(sum(sizes))
    for (a, _), size in zip(spans, sizes):
        if pick < size:
            return a + pick
        pick -= size
    raise AssertionError("unreachable: pick < sum(sizes)")


def free_port_block(count: int, *, host: str = "127.0.0.1", tries: int = DRAW_TRIES,
                    rng: random.Random | None = None) -> int:
    """A base port p with ``p … p+count-1`` all free on ``host`` now, outside the ephemeral range (module
    docstring); raises ``NoFreePorts`` after ``tries`` draws."""
    rng = rng or random.Random()
    spans = draw_spans(count, ephemeral_range(), configured_range())
    for _ in range(tries):
        base = _draw(spans, rng)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise NoFreePorts(f"no block of {count} free ports found on {host} in {tries} draws")


def free_port(host: str = "127.0.0.1") -> int:
    """One port free on ``host`` now, outside the ephemeral range."""
    return free_port_block(1, host=host)


def free_port_blocks(blocks: int, size: int = 1, *, host: str = "127.0.0.1", tries: int = DRAW_TRIES,
                     rng: random.Random | None = None) -> list[int]:
    """Bases of ``blocks`` blocks of ``size`` ports, no two overlapping, each port free on ``host`` now and
    outside the ephemeral range; raises ``NoFreePorts`` after ``tries`` draws that overlapped a block drawn before.

    Apart, not merely free: ports drawn one by one are released until their servers bind them, so a later draw
    can repeat an earlier one. Two local groups would then share a store port (one refused, or a rank joining the
    other group's store); a caller serving one store per job in turn on ports drawn up front would meet the
    previous job's store, still shutting down, on the next job's port. Reproduced with the support matrix: two
    adjacent runs on one port put one rank in the old store, the ranks fell a run apart and every later run timed
    out after 30 s (a CI run, 2026-12-07, lost its 300 s fixture budget this way or alike).
    """
    rng = rng or random.Random()
    bases: list[int] = []
    misses = 0
    while len(bases) < blocks:
        base = free_port_block(size, host=host, tries=tries, rng=rng)
        if any(abs(base - other) < size for other in bases):
            misses += 1
            if misses > tries:
                raise NoFreePorts(f"no {blocks} non-overlapping blocks of {size} free port(s) found on {host} "
                                  f"({len(bases)} after {misses} overlapping draws)")
            continue
        bases.append(base)
    return bases


def free_ports(count: int, *, host: str = "127.0.0.1", tries: int = DRAW_TRIES,
               rng: random.Random | None = None) -> list[int]:
    """``count`` distinct ports, each free on ``host`` now and outside the ephemeral range (``free_port_blocks``
    of one port each)."""
    return free_port_blocks(count, 1, host=host, tries=tries, rng=rng)
