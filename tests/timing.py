"""How the tests wait, and for how long (docs/TESTING.md, "Timing rules").

A test waits for a condition, never for a fixed time: ``wait_until`` polls a predicate until it holds and, at its
deadline, fails naming what it waited for and what it last saw. Deadlines are sized for the CI machine at its worst:
2 cores, two test workers and a busy process beside them, every process importing torch and ``transformers`` at
once. A deadline is a bound on a hang, not a speed goal; speed goals live in ``bench/``.

``hold`` is the one other way time passes in a test: a span that is part of the scenario (a fault that lasts, a
window in which something must *not* happen), never a wait for something to be ready. ``tests/test_suite_rules.py``
refuses any other sleep outside a polling loop.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: a fresh Python process that imports torch (and ``transformers``) and reaches its first useful line: 3-8 s on
#: an idle 2-core machine, several times that beside a second test worker
PROCESS_START_S = 120.0
#: a local group (G x D rank processes and a front) from its launch to ``/readyz`` 200
GROUP_READY_S = 180.0
#: a fault the code detects on a bound of a few seconds (heartbeats, leases) seen detected by the test: the bound
#: itself plus a starved scheduler's worth of slack
DETECTION_S = 60.0
#: a process asked to stop (SIGTERM, a drain) seen gone
EXIT_S = 60.0
#: added to a design bound (a detection time, a server's own timeout) when a test checks in wall-clock time that
#: the bound holds: a starved thread on the loaded CI machine runs seconds late. Large against the slack a quiet
#: machine needs, small against what a broken bound costs (a fallback timeout of a minute, a hang)
LOADED_SLACK_S = 10.0
#: the poll period of ``wait_until``: short beside every deadline, long enough not to load the machine
POLL_S = 0.05


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, *,
               seen: Callable[[], object] | None = None, poll_s: float = POLL_S) -> T:
    """``predicate()``'s first truthy value, polled every ``poll_s``; an ``AssertionError`` at ``timeout_s`` naming
    ``what`` and the last value seen (``seen()`` if given, else the predicate's). An exception raised by the
    predicate is kept as the value seen and polling goes on (a server that is still starting)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            last = predicate()
        except Exception as exc:  # noqa: BLE001 - seen, and polled again
            last = exc
        else:
            if last:
                return last  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    shown = seen() if seen is not None else last
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}; last seen: {shown!r}")


def hold(seconds: float, why: str) -> None:
    """Let ``seconds`` pass as part of the scenario (``why`` says which part); never a wait for a condition."""
    if not why:
        raise ValueError("hold() needs the reason the scenario lets this time pass")
    time.sleep(seconds)


async def hold_async(seconds: float, why: str) -> None:
    """``hold`` inside an event loop (a test server's handler that stalls, a stop that comes later)."""
    import asyncio

    if not why:
        raise ValueError("hold_async() needs the reason the scenario lets this time pass")
    await asyncio.sleep(seconds)
