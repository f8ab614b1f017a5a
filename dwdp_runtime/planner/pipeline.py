"""Two-stream timeline of one DWDP forward: compute stream vs copy stream with ``S`` pool slots.

Pure. Positions ``p`` count MoE layers across forwards (order ``j = p mod M``, slot ``p mod S``),
as in ``schedule.PrefetchSchedule``; the copy for position p may start once the copy engine is
free and slot ``p mod S`` was released by position ``p - S`` (released after that MoE finished):

    copy_start[p] = max(copy_end[p-1], moe_end[p-S])        (slots start free)
    copy_end[p]   = copy_start[p] + T_prefetch
    moe_start[p]  = max(moe_end[p-1] + pre[j] (+ post + head between forwards), copy_end[p])
    moe_end[p]    = moe_start[p] + moe[j]

``pre[j]`` is the compute between MoE j-1 and MoE j (attention of layer j, plus any dense layers
and the embedding before the first MoE layer), ``post`` what follows the last MoE layer (dense
layers after it, LM head). Two forwards are simulated back to back: the first is the cold one,
the second the steady state (its first layers were prefetched during the first forward).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardTimes:
    cold_s: float
    steady_s: float
    compute_s: float   # sum of compute segments of one forward (the no-stall lower bound)
    stall_s: float     # steady_s - compute_s: time the compute stream waited for copies


def simulate(*, pre: list[float], moe: list[float], post: float, t_prefetch: float, slots: int) -> ForwardTimes:
    m = len(moe)
    if m == 0 or len(pre) != m:
        raise ValueError("pre and moe must have one entry per MoE layer")
    if slots < 1:
        raise ValueError("slots must be >= 1")
    n = 2 * m
    copy_end = [0.0] * n
    moe_end = [0.0] * n
    for p in range(n):
        j = p % m
        c0 = max(copy_end[p - 1] if p else 0.0, moe_end[p - slots] if p >= slots else 0.0)
        copy_end[p] = c0 + t_prefetch
        if p == 0:
            ready = pre[0]
        elif j == 0:
            ready = moe_end[p - 1] + post + pre[0]
        else:
            ready = moe_end[p - 1] + pre[j]
        moe_end[p] = max(ready, copy_end[p]) + moe[j]
    cold = moe_end[m - 1] + post
    steady = moe_end[n - 1] + post - cold
    compute = sum(pre) + sum(moe) + post
    return ForwardTimes(cold_s=cold, steady_s=steady, compute_s=compute, stall_s=max(0.0, steady - compute))
