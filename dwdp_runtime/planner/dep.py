"""The DEP baseline: data-parallel attention + expert-parallel MoE with two all-to-alls per MoE layer.

Pure math. ``T_DEP(layer) = T_compute_DEP + T_dispatch + T_combine + T_sync``.

* Experts are split evenly over the ``d`` ranks (rank r holds ``e_r`` = N/d, ±1). Each rank
  computes the routes that land on its experts from all ranks: with equal tokens per rank this is
  on average its own ``T·top_k`` routes, but it reads only ``e_r`` experts' weights.
* All-to-all volumes (per rank, uniform routing, one copy per (token, destination rank) as
  DeepEP/TRT-LLM do): a token's ``top_k`` distinct experts hit rank r with probability
  ``p_r = 1 - C(N - e_r, top_k) / C(N, top_k)``; averaged over the sender's own rank, a token
  goes to ``(d-1)/d · Σ_r p_r`` remote ranks. Dispatch sends ``H`` elements per (token, remote
  rank) at the dtype's activation size, combine returns ``H`` bf16 elements. Each crosses the
  same NVLink port as DWDP's prefetch at the same achieved bandwidth; the traffic is symmetric so
  send and receive overlap (one direction's time counts). Kernel launch/latency terms are ignored.
* Synchronisation: per-rank sequence lengths ``L_r = L·(1 + cv·Z_r)``, ``Z_r`` i.i.d. standard
  normal (clipped at 0 tokens). Every all-to-all waits for the slowest rank. Since a rank's work
  ``g(L_r)`` is increasing in ``L_r``, the slowest rank is the one with the largest ``Z``:
  ``E[max_r g(L_r)] = ∫ g(L(1+cv·z)) · d·φ(z)·Φ(z)^(d-1) dz`` (exact for normal lengths; the
  integral is Simpson's rule on [-8, 8]). The same rank is slowest at every layer, so the waits of
  all layers add. DWDP ranks never wait for each other: they are charged the mean.
"""

from __future__ import annotations

import math
from typing import Callable

_Z_LO, _Z_HI, _Z_STEPS = -8.0, 8.0, 160  # even number of Simpson intervals


def _phi(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _Phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def expected_max_of(g: Callable[[float], float], d: int) -> float:
    """``E[g(max of d standard normals)]`` by Simpson's rule (``g`` any function of z)."""
    if d < 1:
        raise ValueError("d must be >= 1")
    h = (_Z_HI - _Z_LO) / _Z_STEPS
    acc = 0.0
    for i in range(_Z_STEPS + 1):
        z = _Z_LO + i * h
        w = 1 if i in (0, _Z_STEPS) else (4 if i % 2 else 2)
        acc += w * g(z) * d * _phi(z) * _Phi(z) ** (d - 1)
    return acc * h / 3.0


def expected_max_std_normal(d: int) -> float:
    """E[max of d i.i.d. standard normals]: 0, 1/√π, 3/(2√π), … for d = 1, 2, 3."""
    return expected_max_of(lambda z: z, d)


def expected_slowest(work: Callable[[float], float], *, d: int, cv: float) -> float:
    """``E[max_r work(scale_r)]`` with ``scale_r = max(0, 1 + cv·Z_r)``; ``work(1.0)`` when cv == 0."""
    if cv <= 0 or d == 1:
        return work(1.0)
    return expected_max_of(lambda z: work(max(0.0, 1.0 + cv * z)), d)


def expected_mean(work: Callable[[float], float], *, cv: float) -> float:
    """``E[work(max(0, 1 + cv·Z))]`` for one rank; ``work(1.0)`` when cv == 0."""
    if cv <= 0:
        return work(1.0)
    return expected_max_of(lambda z: work(max(0.0, 1.0 + cv * z)), 1)


def experts_per_rank(num_experts: int, d: int) -> list[int]:
    base, extra = divmod(num_experts, d)
    return [base + (1 if r < extra else 0) for r in range(d)]


def remote_ranks_per_token(*, num_experts: int, top_k: int, d: int) -> float:
    """Expected number of *other* ranks a token is dispatched to (one copy per rank)."""
    total = math.comb(num_experts, top_k)
    hits = sum(1.0 - math.comb(num_experts - e_r, top_k) / total for e_r in experts_per_rank(num_experts, d))
    return hits * (d - 1) / d


def all2all_bytes(*, tokens: float, hidden: int, num_experts: int, top_k: int, d: int,
                  dispatch_bytes_per_elem: float, combine_bytes_per_elem: float = 2.0) -> tuple[float, float]:
    """(dispatch, combine) bytes one rank sends (and, by symmetry, receives) per MoE layer."""
    r = remote_ranks_per_token(num_experts=num_experts, top_k=top_k, d=d)
    return tokens * r * hidden * dispatch_bytes_per_elem, tokens * r * hidden * combine_bytes_per_elem
