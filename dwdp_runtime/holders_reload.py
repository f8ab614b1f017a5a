"""Reload of experts without a surviving holder (issue #30): which experts, where they go, what it costs. Pure.

When a rank loss leaves some expert with no alive holder (r = 1 and its sole holder died, or all r holders),
and the group's policy is ``on_uncovered=reload`` (``contract.OnUncovered``), every survivor reads those
experts from the checkpoint into *private* runs of its own — one new allocation per (layer, weight) and run,
never exported (each survivor's composite covers every expert, so every survivor needs them; reading them
locally needs no exchange between ranks and no new handle on any peer).

A private run is then one more stored run of this rank in *its own* view of the holders
(``with_private_runs``): appended to its replica runs, so its handle index is ``len(stored(rank))`` at the time
it was added — the same index ``Transport.add_private_runs`` gives the allocation. ``layout.surviving_owner``
over that view picks this rank for the reloaded experts (no alive primary holds them, and no other alive rank
holds them in this rank's view), so ``WeightBuffer.replan`` sources them from itself with the unchanged rules.

Invariants:
  * ``orphaned_runs`` returns only experts no alive rank stores in the *group's* layout (``config.holders()``)
    and this rank does not already hold privately: a second loss reloads only what it newly orphaned.
  * The private runs are disjoint from everything this rank stores (a rank alive stores none of them).
  * Every rank computes its own view; the group's shared layout (``HolderLayout`` of the config, what peers
    import) never changes — peers never see a private run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .layout import HolderLayout, _runs, handle_bytes


class ReloadRefused(RuntimeError):
    """The survivors cannot reload the experts no one holds any more (no checkpoint reader, the memory backend
    cannot allocate them, the checkpoint changed or is unreadable): the group restarts, with this reason."""


@dataclass(frozen=True)
class ReloadReport:
    """One reload on one rank: which experts came back from the checkpoint, what it cost."""

    experts: tuple[int, ...]            # the experts reloaded (ascending)
    runs: tuple[tuple[int, int], ...]   # the same as contiguous (start, end) runs: one allocation per weight each
    nbytes: int                         # expert bytes written (experts × every (layer, weight)'s expert bytes)
    allocated_bytes: int                # device/host memory the private runs take (granularity-rounded)
    bytes_read: int | None              # bytes read from the checkpoint files (None: the reader does not count)
    seconds: float                      # wall time of allocation + read on this rank

    def describe(self) -> str:
        read = f"{self.bytes_read / 2**20:.2f} MiB read" if self.bytes_read is not None else "read"
        return (f"experts {list(self.experts)} had no surviving holder: reloaded from the checkpoint ({read}, "
                f"{self.allocated_bytes / 2**20:.2f} MiB more memory on this rank, {self.seconds:.2f} s)")


def private_runs_of(view: HolderLayout, shared: HolderLayout, rank: int) -> tuple[tuple[int, int], ...]:
    """The runs ``rank`` holds in ``view`` beyond the group's ``shared`` layout (its private, reloaded runs)."""
    return view.replicas[rank][len(shared.replicas[rank]):]


def orphaned_runs(shared: HolderLayout, alive: Iterable[int], private: Sequence[tuple[int, int]] = ()
                  ) -> tuple[tuple[int, int], ...]:
    """Experts no rank of ``alive`` stores in ``shared``, minus those already in ``private``, as runs."""
    alive = frozenset(alive)
    held = {e for a, b in private for e in range(a, b)}
    return _runs(e for e in range(shared.num_experts)
                 if e not in held and not any(r in alive for r in shared.holders(e)))


def with_private_runs(view: HolderLayout, rank: int, runs: Sequence[tuple[int, int]]) -> HolderLayout:
    """``view`` with ``runs`` appended to ``rank``'s replica runs (handle indices ``len(stored(rank))`` on)."""
    stored = {e for a, b in view.stored(rank) for e in range(a, b)}
    clash = sorted(e for a, b in runs for e in range(a, b) if e in stored)
    if clash:
        raise ValueError(f"rank {rank} already stores experts {clash}: a private run must add experts it lacks")
    replicas = list(view.replicas)
    replicas[rank] = (*replicas[rank], *(tuple(r) for r in runs))
    return HolderLayout(view.primary, tuple(replicas))


def private_bytes(runs: Sequence[tuple[int, int]], expert_bytes: Iterable[int], granularity: int) -> int:
    """Memory the private runs take on one rank: one granularity-rounded allocation per (weight, run)."""
    return sum(handle_bytes(b - a, eb, granularity) for eb in expert_bytes for a, b in runs)
