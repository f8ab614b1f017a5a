"""``Evaluator``: the planner's per-operator roofline model of one model, dtype and GPU.

Every method is a pure function of the parsed inputs (``ModelShape``, ``Hardware``, dtypes) and its
arguments, so ``plan``, ``recommend`` and ``sweep`` all ask the same object and cannot disagree.
The model itself (the per-layer DWDP/DEP formulas, cv expectations, the forward pipeline) is
described in ``plan``'s module docstring; this module only holds it, so ``plan`` → ``recommend`` →
``evaluator`` has no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

from . import dep, pipeline, prefetch, roofline
from .model_shapes import ModelShape, load_model
from .presets import Hardware, WeightDtype, get_dtype, get_hardware

US = 1e6  # seconds → microseconds (every time in a result is in µs)


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
