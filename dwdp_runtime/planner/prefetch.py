"""Which experts each rank pulls from whom, and how long one MoE layer's prefetch takes.

Pure. Ranges and owners come from the runtime's own ``dwdp_runtime.layout`` (``peer_ranges``:
rank r owns ``[r*s, min(r*s + k, N))``; ``lookup_owner``: an expert held by several ranks is pulled
from the lowest one, identical on all ranks), validated by ``config.sharding_errors``. Every non-local expert is pulled once per MoE layer
into the slot pool, i.e. ``remote = N - local`` experts × bytes per expert, independent of routing
(DWDP pulls whole layers, not only the routed experts).

Invariant: ``sum(traffic[dst]) == N - local_count(dst)`` for every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import layout
from ..config import sharding_errors
from . import contention


def expert_ranges(*, dwdp_size: int, num_experts: int, experts_per_worker: int, stride: int) -> list[tuple[int, int]]:
    """``layout.peer_ranges`` after ``sharding_errors`` (ValueError with the runtime's message)."""
    errs = sharding_errors(dwdp_size=dwdp_size, num_experts=num_experts, num_experts_per_worker=experts_per_worker,
                           num_prefetch_experts=stride)
    if errs:
        raise ValueError("invalid DWDP sharding: " + "; ".join(errs))
    return list(layout.peer_ranges(dwdp_size=dwdp_size, num_experts=num_experts,
                                   num_experts_per_worker=experts_per_worker, num_prefetch_experts=stride))


owner = layout.lookup_owner


def owned(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The experts each rank *serves* under the lowest-rank rule: ``[max(a_r, b_{r-1}), b_r)``
    (starts and ends are non-decreasing in r, so an expert's lowest owner is the first range
    containing it)."""
    out, prev_end = [], 0
    for a, b in ranges:
        lo = max(a, prev_end)
        out.append((lo, max(lo, b)))
        prev_end = max(prev_end, b)
    return out


def traffic(ranges: list[tuple[int, int]], num_experts: int) -> list[list[int]]:
    """``m[dst][src]`` = experts rank ``dst`` pulls from rank ``src`` per MoE layer
    (the experts ``src`` serves minus those ``dst`` holds itself)."""
    served = owned(ranges)
    if sum(b - a for a, b in served) != num_experts:
        raise ValueError("ranges do not cover every expert exactly once under the lowest-rank rule")
    d = len(ranges)
    m = [[0] * d for _ in range(d)]
    for dst, (a, b) in enumerate(ranges):
        for src, (lo, hi) in enumerate(served):
            if src != dst:
                m[dst][src] = (hi - lo) - max(0, min(hi, b) - max(lo, a))
    return m


@dataclass(frozen=True)
class PrefetchTime:
    ideal_s: float          # busiest rank's remote bytes / link bandwidth (no contention)
    time_s: float           # with the contention model of the chosen transfer
    contention_factor: float  # time_s / ideal_s
    remote_experts_max: int   # most experts any rank pulls per layer
    remote_bytes_max: float


def layer_prefetch_time(*, traffic_matrix: list[list[int]], expert_bytes: float, link_bytes_per_s: float,
                        contention_opt: bool) -> PrefetchTime:
    """Time for the slowest rank to pull one MoE layer's remote experts.

    ``contention_opt`` (round-robin slicing): open-shop makespan of the byte matrix.
    Otherwise (serial per-peer copies): max over ranks of ingress × E[C], at least the makespan.
    """
    d = len(traffic_matrix)
    bytes_m = [[c * expert_bytes for c in row] for row in traffic_matrix]
    ingress = [sum(r) for r in bytes_m]
    ideal = max(ingress) / link_bytes_per_s
    makespan = contention.open_shop_makespan(bytes_m, link_bytes_per_s)
    if contention_opt:
        t = makespan
    else:
        t = max(makespan, max(contention.serial_pull_time(b, link_bytes_per_s, d) for b in ingress))
    return PrefetchTime(ideal_s=ideal, time_s=t, contention_factor=(t / ideal if ideal else 1.0),
                        remote_experts_max=max(sum(r) for r in traffic_matrix), remote_bytes_max=max(ingress))
