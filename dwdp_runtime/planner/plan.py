"""``plan()``: the roofline comparison of DWDP against DEP for one model, dtype, GPU and workload.

Pipeline (all pure Python):
  1. shapes   — ``model_shapes.load_model`` (preset or config.json) → ``ModelShape``.
  2. compute  — ``roofline.layer_ops`` per layer: DWDP ranks run all ``E`` experts on their own
                ``T = isl·batch`` tokens; DEP ranks run ``E/d`` experts on the routes of all ranks.
  3. prefetch — ``prefetch.traffic`` (who pulls what from whom) → ``layer_prefetch_time`` with the
                contention model of ``contention`` (serial copies or round-robin slicing).
  4. per MoE layer (the paper's model, headline numbers):
                T_DWDP = max(T_compute·(1 + tax·min(1, T_prefetch/T_compute)), T_prefetch)
                T_DEP  = T_compute_DEP + T_dispatch + T_combine + T_sync
                ``tax`` is the hardware's measured slow-down of compute under concurrent copies.
                With cv > 0 both are expectations over per-rank lengths L·(1 + cv·Z): DWDP the mean
                (ranks never wait), DEP the slowest of d (``dep.expected_slowest``).
  5. forward  — ``pipeline.simulate`` (slots, dense layers, cross-forward prefetch) for DWDP and
                the sum of layers for DEP.
  6. crossover — the smallest ``isl`` where T_DEP/T_DWDP >= 1 at this batch (geometric scan of
                 128 … 1 Mi tokens, then bisection to one token).
  7. memory + recommendation (``memory``, ``recommend``).
Invariant: no number in the result is read from anywhere but the inputs and ``presets``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel

from ..config import DEFAULT_PREFETCH_SLOTS, suggest_sharding
from . import prefetch
from .evaluator import US, Evaluator, LayerTimes
from .memory import MemoryBreakdown, breakdown
from .recommend import recommend

__all__ = ["CROSSOVER_MAX", "CROSSOVER_MIN", "Evaluator", "LayerTimes", "PlanResult", "find_crossover", "plan"]

CROSSOVER_MIN, CROSSOVER_MAX = 128, 1 << 20


def find_crossover(speedup_at, *, lo: int = CROSSOVER_MIN, hi: int = CROSSOVER_MAX) -> tuple[int | None, str]:
    """The smallest integer ``isl`` in [lo, hi] where ``speedup_at(isl) >= 1``, found by a geometric
    scan (4 points per octave) and bisection. Returns (isl or None, note)."""
    if speedup_at(lo) >= 1:
        return None, f"DWDP is not slower than DEP at any scanned length (already at isl={lo})"
    prev = lo
    x = lo
    while x < hi:
        x = min(hi, int(math.ceil(x * 2 ** 0.25)))
        if speedup_at(x) >= 1:
            a, b = prev, x  # speedup(a) < 1 <= speedup(b)
            while b - a > 1:
                mid = (a + b) // 2
                if speedup_at(mid) >= 1:
                    b = mid
                else:
                    a = mid
            return b, f"DWDP overtakes DEP at isl={b} tokens (batch fixed)"
        prev = x
    return None, f"DWDP does not overtake DEP below isl={hi}"


class PlanResult(BaseModel):
    """The planner's answer; ``to_json()`` is the CLI's ``--json`` object. Times in µs."""

    model: str
    dtype: str
    dense_dtype: str
    hardware: str
    isl: int
    batch: int
    cv: float
    dwdp_size: int
    experts_per_worker: int
    prefetch_stride: int
    prefetch_slots: int
    contention_opt: bool
    expert_replicas: int = 1
    t_compute_us: float
    t_compute_dwdp_us: float
    t_prefetch_us: float
    t_prefetch_ideal_us: float
    contention_factor: float
    t_dwdp_us: float
    t_compute_dep_us: float
    t_all2all_us: float
    t_sync_us: float
    t_dep_us: float
    speedup: float
    compute_over_prefetch: float
    crossover_isl: int | None
    crossover_note: str
    forward: dict[str, float]
    remote_experts_per_layer: int
    remote_gib_per_layer: float
    memory_gib: dict[str, float]
    fits: bool
    recommended: dict[str, Any] | None
    notes: list[str]

    def to_json(self, **kw) -> str:
        return json.dumps(self.model_dump(), **kw)


def plan(*, model="deepseek-r1", dtype="bf16", hardware="h200-hgx", isl: int = 8192, batch: int = 1,
         cv: float = 0.0, dwdp_size: int = 4, experts_per_worker: int | None = None,
         prefetch_stride: int | None = None, prefetch_slots: int = DEFAULT_PREFETCH_SLOTS, contention_opt: bool = False,
         dense_dtype=None, with_crossover: bool = True, with_recommendation: bool = True,
         expert_replicas: int = 1, fp4_kernel: str = "auto") -> PlanResult:
    """Predict DWDP vs DEP for one configuration (see the module docstring for the model).

    ``experts_per_worker``/``prefetch_stride`` default to ``config.suggest_sharding``; ``fp4_kernel`` is the
    workers' ``DWDP_FP4_KERNEL`` (FP4 dtypes: W4A8's scratch, ``memory.w4a8_scratch``). Raises
    ``ValueError`` (incl. ``ModelConfigError``/``PresetError``) on bad input, with a message.
    """
    if isl < 1 or batch < 1:
        raise ValueError(f"isl={isl}, batch={batch}: both must be >= 1")
    if cv < 0:
        raise ValueError(f"cv={cv}: a coefficient of variation is >= 0")
    ev = Evaluator(model=model, dtype=dtype, hardware=hardware, dense_dtype=dense_dtype, contention_opt=contention_opt)
    shape, hw = ev.shape, ev.hw
    n = shape.num_experts
    sk, ss = suggest_sharding(dwdp_size=dwdp_size, num_experts=n)
    k = sk if experts_per_worker is None else experts_per_worker
    s = (max(1, min(k, math.ceil((n - k) / max(dwdp_size - 1, 1)))) if experts_per_worker is not None else ss) \
        if prefetch_stride is None else prefetch_stride
    ranges = prefetch.expert_ranges(dwdp_size=dwdp_size, num_experts=n, experts_per_worker=k, stride=s)
    if prefetch_slots < 2:
        raise ValueError(f"num_prefetch_slots={prefetch_slots}: at least 2 slots are needed")
    if not 1 <= expert_replicas <= dwdp_size:
        raise ValueError(f"expert_replicas={expert_replicas} must be in [1, dwdp_size={dwdp_size}]")
    pf = ev.prefetch(dwdp_size=dwdp_size, k=k, s=s)
    lt = ev.layer_times(isl=isl, batch=batch, cv=cv, d=dwdp_size, pf=pf)
    fwd = ev.forward(isl=isl, batch=batch, cv=cv, d=dwdp_size, pf=pf, slots=prefetch_slots)
    if with_crossover:
        cross, cross_note = find_crossover(
            lambda x: ev.layer_times(isl=x, batch=batch, cv=cv, d=dwdp_size, pf=pf).speedup)
    else:
        cross, cross_note = None, "not computed"
    mem: MemoryBreakdown = breakdown(model=shape, dtype=ev.dt, hardware=hw, ranges=ranges, experts_per_worker=k,
                                     prefetch_slots=prefetch_slots, dense_dtype=ev.ddt,
                                     max_num_tokens=isl * batch, kv_tokens=isl * batch,
                                     expert_replicas=expert_replicas, fp4_kernel=fp4_kernel)
    rec = None
    if with_recommendation:
        rec = recommend(ev, isl=isl, batch=batch, fp4_kernel=fp4_kernel)
    notes = []
    if not mem.fits_weights:
        notes.append("weights, experts and pool slots exceed GPU memory: this configuration cannot run")
    elif not mem.fits:
        notes.append("weights fit, but not the KV cache of this workload")
    if not shape.is_mla and shape.num_experts <= 8:
        notes.append("few large experts: DWDP pulls whole experts, so prefetch is heavy per layer")
    return PlanResult(
        model=shape.name, dtype=ev.dt.name, dense_dtype=ev.ddt.name, hardware=hw.name, isl=isl, batch=batch,
        cv=cv, dwdp_size=dwdp_size, experts_per_worker=k, prefetch_stride=s, prefetch_slots=prefetch_slots,
        contention_opt=contention_opt, expert_replicas=expert_replicas,
        t_compute_us=lt.t_compute * US, t_compute_dwdp_us=lt.t_compute_dwdp * US, t_prefetch_us=lt.t_prefetch * US,
        t_prefetch_ideal_us=lt.t_prefetch_ideal * US, contention_factor=pf.contention_factor,
        t_dwdp_us=lt.t_dwdp * US, t_compute_dep_us=lt.t_compute_dep * US, t_all2all_us=lt.t_all2all * US,
        t_sync_us=lt.t_sync * US, t_dep_us=lt.t_dep * US, speedup=lt.speedup,
        compute_over_prefetch=(lt.t_compute / lt.t_prefetch if lt.t_prefetch else float("inf")),
        crossover_isl=cross, crossover_note=cross_note, forward=fwd,
        remote_experts_per_layer=pf.remote_experts_max, remote_gib_per_layer=pf.remote_bytes_max / (1 << 30),
        memory_gib=mem.gib(), fits=mem.fits, recommended=rec, notes=notes)
