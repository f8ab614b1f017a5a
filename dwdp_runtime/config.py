"""DWDP group configuration and the sharding rules, shared by the runtime, the CRD and the operator.

Pure Python (no torch): the operator image imports this module to validate a DwdpGroup with
exactly the rules the runtime enforces. The transfer modes are ``contract.Transfer`` (re-exported
here as ``TRANSFER_MODES`` / ``TransferMode``).

Rules (each error message names the rule and suggests a fix):
  1. ``dwdp_size >= 2``                    — one rank has no peer to pull from (that is plain DP).
  2. ``1 <= k <= N``                       — a rank cannot hold more experts than exist.
  3. ``1 <= s <= k``                       — a stride larger than k leaves holes between ranges.
  4. ``(d - 1) * s + k >= N`` (coverage)   — the last range must reach the last expert.
  5. ``(d - 1) * s < N``                  — the last rank must own at least one expert.
  6. ``num_prefetch_slots >= 2``           — one slot would serialise copy and compute.
  7. ``num_groups >= 1``.
  8. ``1 <= expert_replicas <= d``         — every expert on at least r distinct ranks (a rank stores
     its ring predecessors' experts too, ``layout.holder_layout``): r ranks cannot be found in a
     group of fewer; each step of r costs about k more experts of memory per rank.
  9. ``on_uncovered`` in ``contract.OnUncovered`` (``restart`` | ``reload``): what a rank loss that leaves an
     expert without a surviving holder does (``DwdpConfig.elastic``, ``membership.group_survives``).
with d = dwdp_size, N = num_experts, k = num_experts_per_worker, s = num_prefetch_experts.
Rank r owns experts ``[r*s, min(r*s + k, N))`` (see ``layout.peer_ranges``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from . import layout
from .contract import DEFAULT_ON_UNCOVERED, DEFAULT_TRANSFER, ON_UNCOVERED_POLICIES, TRANSFER_MODES, OnUncovered, TransferMode

__all__ = ["TRANSFER_MODES", "TransferMode", "DwdpConfig", "sharding_errors", "suggest_sharding", "MIN_PREFETCH_SLOTS",
           "DEFAULT_PREFETCH_SLOTS"]

#: rule 6: one slot would serialise the copy of the next layer and the compute of this one
MIN_PREFETCH_SLOTS = 2
#: the fewest that overlap: more slots cost GPU memory (a layer's pages each) and buy slack for uneven layers
DEFAULT_PREFETCH_SLOTS = MIN_PREFETCH_SLOTS


def suggest_sharding(*, dwdp_size: int, num_experts: int) -> tuple[int, int]:
    """The smallest (k, s) that covers ``num_experts`` with ``dwdp_size`` ranks.

    k = ceil(N / d) experts per worker, s = ceil((N - k) / (d - 1)) stride; e.g. d=3, N=256 → (86, 85).
    """
    d, n = max(dwdp_size, 2), max(num_experts, 1)
    k = math.ceil(n / d)
    s = max(1, math.ceil((n - k) / (d - 1)))
    return k, min(s, k)


def sharding_errors(
    *,
    dwdp_size: int,
    num_experts: int,
    num_experts_per_worker: int,
    num_prefetch_experts: int,
    num_prefetch_slots: int = DEFAULT_PREFETCH_SLOTS,
    num_groups: int = 1,
    expert_replicas: int = 1,
) -> list[str]:
    """Every violated rule as a human message with a suggested fix; ``[]`` when valid.

    The one implementation of the rules: ``DwdpConfig``, the operator and the CRD tests call it.
    """
    d, n, k, s = dwdp_size, num_experts, num_experts_per_worker, num_prefetch_experts
    errors: list[str] = []
    if num_groups < 1:
        errors.append(f"num_groups={num_groups}: must be >= 1")
    if n < 1:
        errors.append(f"num_experts={n}: must be >= 1")
        return errors
    if d < 2:
        errors.append(
            f"dwdp_size={d}: DWDP needs at least 2 ranks per group (with 1 rank every expert is "
            f"local; run plain data parallel instead, or set dwdp_size >= 2)"
        )
        return errors
    hint_k, hint_s = suggest_sharding(dwdp_size=d, num_experts=n)
    hint = f"dwdp_size={d}, num_experts={n}: try num_experts_per_worker={hint_k}, num_prefetch_experts={hint_s}"
    if not 1 <= k <= n:
        errors.append(f"num_experts_per_worker={k} must be in [1, num_experts={n}]; {hint}")
    if not 1 <= s:
        errors.append(f"num_prefetch_experts={s} must be >= 1; {hint}")
    elif s > k:
        errors.append(
            f"num_prefetch_experts={s} > num_experts_per_worker={k} leaves experts owned by no rank "
            f"(stride must be <= experts per worker); {hint}"
        )
    if k >= 1 and s >= 1 and (d - 1) * s + k < n:
        errors.append(
            f"coverage rule (dwdp_size-1)*num_prefetch_experts + num_experts_per_worker >= num_experts "
            f"fails: ({d}-1)*{s} + {k} = {(d - 1) * s + k} < {n}; {hint}"
        )
    if k >= 1 and s >= 1 and (d - 1) * s >= n:
        errors.append(
            f"rank {d - 1} would start at expert {(d - 1) * s} >= num_experts={n} and hold nothing "
            f"(every rank must own at least one expert: (dwdp_size-1)*num_prefetch_experts < num_experts); {hint}"
        )
    if not 1 <= expert_replicas <= d:
        errors.append(replica_error(dwdp_size=d, num_experts=n, num_experts_per_worker=k,
                                    num_prefetch_experts=s, expert_replicas=expert_replicas, valid=not errors))
    if num_prefetch_slots < MIN_PREFETCH_SLOTS:
        errors.append(
            f"num_prefetch_slots={num_prefetch_slots}: at least {MIN_PREFETCH_SLOTS} slots are needed so the copy of "
            f"the next layer overlaps the compute of this one; set num_prefetch_slots={MIN_PREFETCH_SLOTS}"
        )
    return errors


def replica_error(*, dwdp_size: int, num_experts: int, num_experts_per_worker: int, num_prefetch_experts: int,
                  expert_replicas: int, valid: bool = True) -> str:
    """The message for an out-of-range ``expert_replicas``, with what each r in range costs per rank."""
    d, r = dwdp_size, expert_replicas
    head = (f"expert_replicas={r} must be in [1, dwdp_size={d}]: every expert is stored on r distinct ranks "
            f"of the group (r=1: no spare copy, a lost rank's experts are gone with it)")
    if not valid:
        return head
    costs = []
    for rr in sorted({1, 2, d}):
        h = layout.holder_layout(dwdp_size=d, num_experts=num_experts, num_experts_per_worker=num_experts_per_worker,
                                 num_prefetch_experts=num_prefetch_experts, expert_replicas=rr)
        most = max(h.stored_experts(i) for i in range(d))
        costs.append(f"r={rr}: up to {most} of {num_experts} experts per rank")
    return head + "; memory per rank grows with r (" + ", ".join(costs) + ")"


@dataclass(frozen=True, kw_only=True)
class DwdpConfig:
    """One DWDP deployment: group shape, expert sharding and prefetch knobs (validated at construction)."""

    dwdp_size: int
    num_experts: int
    num_experts_per_worker: int
    num_prefetch_experts: int
    num_groups: int = 1
    num_prefetch_slots: int = DEFAULT_PREFETCH_SLOTS
    contention_opt: bool = False
    transfer: TransferMode = DEFAULT_TRANSFER
    expert_replicas: int = 1  # every expert on >= this many ranks (1 = no spare copy: today's layout)
    # an expert without a surviving holder after a loss: ``restart`` the group (today) or ``reload`` it from the
    # checkpoint on every survivor (``contract.OnUncovered``; ``DwdpManager.reload_uncovered``)
    on_uncovered: str = DEFAULT_ON_UNCOVERED

    def __post_init__(self) -> None:
        errors = sharding_errors(
            dwdp_size=self.dwdp_size,
            num_experts=self.num_experts,
            num_experts_per_worker=self.num_experts_per_worker,
            num_prefetch_experts=self.num_prefetch_experts,
            num_prefetch_slots=self.num_prefetch_slots,
            num_groups=self.num_groups,
            expert_replicas=self.expert_replicas,
        )
        if self.transfer not in TRANSFER_MODES:
            errors.append(f"transfer={self.transfer!r}: must be one of {', '.join(TRANSFER_MODES)}")
        if self.on_uncovered not in ON_UNCOVERED_POLICIES:
            errors.append(f"on_uncovered={self.on_uncovered!r}: must be one of {', '.join(ON_UNCOVERED_POLICIES)}")
        if errors:
            raise ValueError("invalid DWDP config: " + "; ".join(errors))

    @classmethod
    def even(cls, *, dwdp_size: int, num_experts: int, **kw) -> "DwdpConfig":
        """A config with the suggested minimal (k, s) for this group size."""
        k, s = suggest_sharding(dwdp_size=dwdp_size, num_experts=num_experts)
        return cls(dwdp_size=dwdp_size, num_experts=num_experts, num_experts_per_worker=k,
                   num_prefetch_experts=s, **kw)

    @property
    def elastic(self) -> bool:
        """Whether a rank loss is survived in place (peers judged by ``PeerMonitor(elastic=True)``, membership
        epochs, re-plans): with spare copies (r ≥ 2), or with ``on_uncovered=reload`` (the survivors reload the
        lost experts from the checkpoint, so even r = 1 survives)."""
        return self.expert_replicas > 1 or self.on_uncovered == OnUncovered.RELOAD

    def holders(self) -> "layout.HolderLayout":
        """Primary ranges and replica runs of every rank (``layout.holder_layout``)."""
        return layout.holder_layout(dwdp_size=self.dwdp_size, num_experts=self.num_experts,
                                    num_experts_per_worker=self.num_experts_per_worker,
                                    num_prefetch_experts=self.num_prefetch_experts,
                                    expert_replicas=self.expert_replicas)

    def to_dict(self) -> dict:
        return asdict(self)
