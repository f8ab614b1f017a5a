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
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from pydantic import BaseModel

from ..config import suggest_sharding
from . import dep, pipeline, prefetch, roofline
from .memory import MemoryBreakdown, breakdown
from .model_shapes import ModelShape, load_model
from .presets import Hardware, WeightDtype, get_dtype, get_hardware

US = 1e6
CROSSOVER_MIN, CROSSOVER_MAX = 128, 1 << 20


@dataclass(frozen=True)
class LayerTimes:
    """Seconds, one MoE layer, expected over the cv distribution."""
    t_compute: float        # DWDP rank, roofline, no copy interference
    t_compute_dwdp: float   # with the copy/compute tax
    t_prefetch: float
    t_prefetch_ideal: float
    t_dwdp: float
    t_compute_dep: float    # DEP mean rank
    t_all2all: float
    t_sync: float
    t_dep: float

    @property
    def speedup(self) -> float:
        return self.t_dep / self.t_dwdp


class Evaluator:
    """Caches the parsed inputs; every method is a pure function of them and its arguments."""

    def __init__(self, *, model, dtype, hardware, dense_dtype=None, contention_opt: bool = False):
        self.shape: ModelShape = load_model(model)
        self.hw: Hardware = get_hardware(hardware)
        self.dt: WeightDtype = get_dtype(dtype)
        self.ddt: WeightDtype = get_dtype(dense_dtype) if dense_dtype is not None else self.dt
        self.contention_opt = contention_opt

    # ---- compute ------------------------------------------------------------------------------
    def layer_compute(self, *, seq: float, batch: int, moe: bool, dep_d: int | None = None,
                      route_seq: float | None = None) -> float:
        """One layer on one rank. ``dep_d`` set: DEP with d ranks whose *mean* length is ``route_seq``."""
        kw: dict[str, Any] = {}
        if moe and dep_d:
            kw = dict(pool_experts=self.shape.num_experts / dep_d,
                      route_tokens=dep_d * (seq if route_seq is None else route_seq) * batch)
        return roofline.total_time(roofline.layer_ops(self.shape, self.hw, dtype=self.dt, dense_dtype=self.ddt,
                                                      seq=seq, batch=batch, moe=moe, **kw))

    def head_compute(self, *, seq: float, batch: int) -> float:
        return roofline.total_time(roofline.head_ops(self.shape, self.hw, seq=seq, batch=batch))

    # ---- prefetch -----------------------------------------------------------------------------
    @cached_property
    def expert_bytes(self) -> float:
        return self.shape.expert_params * self.dt.bytes_per_element

    def prefetch(self, *, dwdp_size: int, k: int, s: int) -> prefetch.PrefetchTime:
        ranges = prefetch.expert_ranges(dwdp_size=dwdp_size, num_experts=self.shape.num_experts,
                                        experts_per_worker=k, stride=s)
        return prefetch.layer_prefetch_time(traffic_matrix=prefetch.traffic(ranges, self.shape.num_experts),
                                            expert_bytes=self.expert_bytes,
                                            link_bytes_per_s=self.hw.link_bytes_per_s,
                                            contention_opt=self.contention_opt)

    def taxed(self, t_compute: float, t_prefetch: float) -> float:
        if t_compute <= 0:
            return 0.0
        return t_compute * (1.0 + self.hw.copy_compute_tax * min(1.0, t_prefetch / t_compute))

    # ---- all-to-all ---------------------------------------------------------------------------
    def all2all(self, *, seq: float, batch: int, d: int) -> float:
        disp, comb = dep.all2all_bytes(tokens=seq * batch, hidden=self.shape.hidden,
                                       num_experts=self.shape.num_experts, top_k=self.shape.top_k, d=d,
                                       dispatch_bytes_per_elem=self.dt.act_bytes)
        return (disp + comb) / self.hw.link_bytes_per_s

    # ---- the per-layer model ------------------------------------------------------------------
    def layer_times(self, *, isl: float, batch: int, cv: float, d: int, pf: prefetch.PrefetchTime) -> LayerTimes:
        tp = pf.time_s

        @lru_cache(maxsize=None)
        def dwdp_terms(scale: float) -> tuple[float, float, float]:
            tc = self.layer_compute(seq=isl * scale, batch=batch, moe=True)
            tcx = self.taxed(tc, tp)
            return tc, tcx, max(tcx, tp)

        tc = dep.expected_mean(lambda x: dwdp_terms(x)[0], cv=cv)
        tcx = dep.expected_mean(lambda x: dwdp_terms(x)[1], cv=cv)
        t_dwdp = dep.expected_mean(lambda x: dwdp_terms(x)[2], cv=cv)

        @lru_cache(maxsize=None)
        def dep_work(scale: float) -> float:
            return self.layer_compute(seq=isl * scale, batch=batch, moe=True, dep_d=d, route_seq=isl)

        tc_dep = dep.expected_mean(dep_work, cv=cv)
        slowest = dep.expected_slowest(dep_work, d=d, cv=cv)
        a2a = self.all2all(seq=isl, batch=batch, d=d)
        return LayerTimes(t_compute=tc, t_compute_dwdp=tcx, t_prefetch=tp, t_prefetch_ideal=pf.ideal_s,
                          t_dwdp=t_dwdp, t_compute_dep=tc_dep, t_all2all=a2a, t_sync=slowest - tc_dep,
                          t_dep=slowest + a2a)

    # ---- whole forward ------------------------------------------------------------------------
    def forward_segments(self, *, seq: float, batch: int, t_prefetch: float) -> tuple[list[float], list[float], float]:
        """(pre, moe, post) compute segments of a DWDP forward for ``pipeline.simulate`` (taxed)."""
        moe_set = set(self.shape.moe_layers)
        dense_t = self.taxed(self.layer_compute(seq=seq, batch=batch, moe=False), t_prefetch) if \
            len(moe_set) < self.shape.num_layers else 0.0
        ops = roofline.layer_ops(self.shape, self.hw, dtype=self.dt, dense_dtype=self.ddt, seq=seq, batch=batch,
                                 moe=True)
        attn = self.taxed(sum(o.time for o in ops if not o.name.startswith("moe.")), t_prefetch)
        moe_t = self.taxed(sum(o.time for o in ops if o.name.startswith("moe.")), t_prefetch)
        head = roofline.head_ops(self.shape, self.hw, seq=seq, batch=batch)
        pre, moe, acc = [], [], head[0].time  # embedding before the first layer
        for layer in range(self.shape.num_layers):
            if layer in moe_set:
                pre.append(acc + attn)
                moe.append(moe_t)
                acc = 0.0
            else:
                acc += dense_t
        return pre, moe, acc + head[1].time

    def forward(self, *, isl: float, batch: int, cv: float, d: int, pf: prefetch.PrefetchTime,
                slots: int) -> dict[str, float]:
        m = self.shape.num_moe_layers
        dense_layers = self.shape.num_layers - m

        def dwdp_fwd(scale: float) -> float:
            pre, moe, post = self.forward_segments(seq=isl * scale, batch=batch, t_prefetch=pf.time_s)
            return pipeline.simulate(pre=pre, moe=moe, post=post, t_prefetch=pf.time_s, slots=slots).steady_s

        def dep_fwd(scale: float) -> float:
            s = isl * scale
            return (m * self.layer_compute(seq=s, batch=batch, moe=True, dep_d=d, route_seq=isl)
                    + dense_layers * (self.layer_compute(seq=s, batch=batch, moe=False) if dense_layers else 0.0)
                    + self.head_compute(seq=s, batch=batch))

        t_dwdp = dep.expected_mean(dwdp_fwd, cv=cv)
        t_dep = dep.expected_slowest(dep_fwd, d=d, cv=cv) + m * self.all2all(seq=isl, batch=batch, d=d)
        return {"dwdp_us": t_dwdp * US, "dep_us": t_dep * US, "speedup": t_dep / t_dwdp}


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
         prefetch_stride: int | None = None, prefetch_slots: int = 2, contention_opt: bool = False,
         dense_dtype=None, with_crossover: bool = True, with_recommendation: bool = True) -> PlanResult:
    """Predict DWDP vs DEP for one configuration (see the module docstring for the model).

    ``experts_per_worker``/``prefetch_stride`` default to ``config.suggest_sharding``. Raises
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
                                     max_num_tokens=isl * batch, kv_tokens=isl * batch)
    rec = None
    if with_recommendation:
        from .recommend import recommend
        rec = recommend(ev, isl=isl, batch=batch)
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
        contention_opt=contention_opt,
        t_compute_us=lt.t_compute * US, t_compute_dwdp_us=lt.t_compute_dwdp * US, t_prefetch_us=lt.t_prefetch * US,
        t_prefetch_ideal_us=lt.t_prefetch_ideal * US, contention_factor=pf.contention_factor,
        t_dwdp_us=lt.t_dwdp * US, t_compute_dep_us=lt.t_compute_dep * US, t_all2all_us=lt.t_all2all * US,
        t_sync_us=lt.t_sync * US, t_dep_us=lt.t_dep * US, speedup=lt.speedup,
        compute_over_prefetch=(lt.t_compute / lt.t_prefetch if lt.t_prefetch else float("inf")),
        crossover_isl=cross, crossover_note=cross_note, forward=fwd,
        remote_experts_per_layer=pf.remote_experts_max, remote_gib_per_layer=pf.remote_bytes_max / (1 << 30),
        memory_gib=mem.gib(), fits=mem.fits, recommended=rec, notes=notes)
