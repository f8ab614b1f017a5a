"""Recommend (dwdp_size, experts_per_worker, stride, slots) for a workload and a memory budget.

Pure. Search space: ``d`` in 2..hardware.max_group, ``k`` from ``suggest_sharding``'s minimum up to
``N``, stride ``s = ceil((N - k)/(d - 1))`` (the smallest that covers, spreading the overlap
evenly), slots 2..4; only triples ``config.sharding_errors`` accepts. A candidate is feasible when
weights + local experts + pool slots + activations + reserve fit one GPU and leave at least ``max(KV of the workload (isl·batch tokens),
MIN_KV_FRACTION × memory)`` for the KV cache — a serving policy (room for more than one batch in
flight), not physics: without it the search trades every spare byte for local experts.

Objective, in order (DWDP ranks are independent, so per-GPU throughput = tokens / per-rank time):
  1. the per-MoE-layer ``T_DWDP`` (cv = 0) — lower is better;
  2. among candidates within 1 % of the best: the most memory left for KV cache;
  3. then the smaller ``d`` (smaller failure domain).
Slots: more slots never lower the steady-state per-layer time; they can only help the forward
(prefetch running ahead through dense layers). The forward pipeline is simulated for slots 2..4 of
the winner and the fewest slots within 0.5 % of the best forward kept.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import DEFAULT_PREFETCH_SLOTS, sharding_errors, suggest_sharding
from . import memory, pipeline, prefetch
from .evaluator import Evaluator

TIE = 0.01
MIN_KV_FRACTION = 0.10
SLOT_TIE = 0.005
MAX_SLOTS = 4


def candidates(num_experts: int, max_group: int):
    for d in range(2, max_group + 1):
        k_min, _ = suggest_sharding(dwdp_size=d, num_experts=num_experts)
        for k in range(k_min, num_experts + 1):
            s = max(1, min(k, math.ceil((num_experts - k) / (d - 1))))
            if not sharding_errors(dwdp_size=d, num_experts=num_experts, num_experts_per_worker=k,
                                   num_prefetch_experts=s):
                yield d, k, s


def recommend(ev: Evaluator, *, isl: int, batch: int, fp4_kernel: str = "auto") -> dict[str, Any] | None:
    shape, hw = ev.shape, ev.hw
    n = shape.num_experts
    tokens = isl * batch
    tc = ev.layer_compute(seq=isl, batch=batch, moe=True)
    kv_floor = max(tokens * shape.kv_bytes_per_token(), MIN_KV_FRACTION * hw.memory_bytes)
    scored = []
    for d, k, s in candidates(n, hw.max_group):
        ranges = prefetch.expert_ranges(dwdp_size=d, num_experts=n, experts_per_worker=k, stride=s)
        mem = memory.breakdown(model=shape, dtype=ev.dt, hardware=hw, ranges=ranges, experts_per_worker=k,
                               prefetch_slots=DEFAULT_PREFETCH_SLOTS, dense_dtype=ev.ddt, max_num_tokens=tokens,
                               kv_tokens=tokens, fp4_kernel=fp4_kernel)
        if mem.kv_cache_available < kv_floor:
            continue
        pf = ev.prefetch(dwdp_size=d, k=k, s=s)
        t = max(ev.taxed(tc, pf.time_s), pf.time_s)
        scored.append((t, -mem.kv_cache_available, d, k, s, pf, mem))
    if not scored:
        return None
    best_t = min(c[0] for c in scored)
    t, _, d, k, s, pf, mem = min((c for c in scored if c[0] <= best_t * (1 + TIE)), key=lambda c: (c[1], c[2], c[3]))
    ranges = prefetch.expert_ranges(dwdp_size=d, num_experts=n, experts_per_worker=k, stride=s)
    pre, moe, post = ev.forward_segments(seq=isl, batch=batch, t_prefetch=pf.time_s)
    fwd = {}
    for slots in range(2, MAX_SLOTS + 1):
        m = memory.breakdown(model=shape, dtype=ev.dt, hardware=hw, ranges=ranges, experts_per_worker=k,
                             prefetch_slots=slots, dense_dtype=ev.ddt, max_num_tokens=tokens, kv_tokens=tokens,
                             fp4_kernel=fp4_kernel)
        if m.kv_cache_available >= kv_floor:
            fwd[slots] = (pipeline.simulate(pre=pre, moe=moe, post=post, t_prefetch=pf.time_s, slots=slots).steady_s, m)
    best_f = min(v[0] for v in fwd.values())
    slots = min(sl for sl, v in fwd.items() if v[0] <= best_f * (1 + SLOT_TIE))
    f, mem = fwd[slots]
    return {"dwdp_size": d, "experts_per_worker": k, "prefetch_stride": s, "prefetch_slots": slots,
            "t_dwdp_us": t * 1e6, "forward_dwdp_us": f * 1e6,
            "kv_cache_available_gib": round(mem.kv_cache_available / memory.GIB, 3),
            "why": (f"lowest per-layer T_DWDP leaving >= {kv_floor / memory.GIB:.1f} GiB for KV cache "
                    f"(max of this workload's KV and {MIN_KV_FRACTION:.0%} of memory); ties (1 %) broken by "
                    f"KV headroom, then smaller group")}
