"""Group-restart backoff: pure math, no clock and no I/O.

Invariants:
  1. ``backoff_seconds(n)`` for the n-th restart (n = 0 for the first) is ``base * 2**n``, capped at
     ``MAX_BACKOFF_SECONDS`` (and never below 0); monotone non-decreasing in n.
  2. A group that has already restarted ``maxRestarts`` times is Failed on its next failure:
     ``exhausted(restarts, max_restarts)``.
"""

from __future__ import annotations

MAX_BACKOFF_SECONDS = 300.0


def backoff_seconds(restarts_so_far: int, *, base: float, cap: float = MAX_BACKOFF_SECONDS) -> float:
    """Delay before recreating a group that has restarted ``restarts_so_far`` times already."""
    if base <= 0:
        return 0.0
    n = max(0, int(restarts_so_far))
    if n >= 32:  # 2**32 * base is past any cap; avoid float overflow on silly inputs
        return float(max(cap, 0.0))
    return float(min(base * (2 ** n), max(cap, base)))


def exhausted(restarts_so_far: int, *, max_restarts: int) -> bool:
    """True when one more failure must mark the group Failed instead of restarting it."""
    return restarts_so_far >= max_restarts
