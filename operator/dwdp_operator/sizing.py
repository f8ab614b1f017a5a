"""Sizing a DwdpGroup with the planner: refuse what cannot fit GPU memory, show the predicted gain.

Only when ``spec.sizing`` names a model preset (or a config.json reachable by the operator) and a
hardware preset: the operator cannot read model files on the nodes, so it never guesses a model.

  * ``memory_fit_errors(spec)`` — ``[]`` or one message with the numbers (an Invalid condition);
    registered as a ``validate_spec`` check (``@register_check``) when this module is imported;
  * ``sizing_status(spec)``     — ``status.sizing``: fits, message, predicted T_DEP/T_DWDP per layer.
Both call ``dwdp_runtime.planner`` (pure Python) and are cached per sizing input: reconciles
repeat often, the answer changes only with the spec.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from .spec import DwdpGroupSpec, register_check


def _key(spec: DwdpGroupSpec) -> tuple | None:
    s, e = spec.sizing, spec.experts
    if s is None:
        return None
    return (s.model, s.weightDtype, s.hardware, s.isl, s.minKvGiB, spec.dwdpSize, e.numExpertsPerWorker,
            e.numPrefetchExperts, e.numPrefetchSlots, e.contentionOpt, e.replicas)


@lru_cache(maxsize=256)
def _fit(key: tuple) -> tuple[bool, str]:
    from dwdp_runtime.planner import memory_fit

    model, dtype, hw, _isl, min_kv, d, k, s, slots, _copt, replicas = key
    fits, message, _ = memory_fit(model=model, dtype=dtype, hardware=hw, dwdp_size=d, experts_per_worker=k,
                                  prefetch_stride=s, prefetch_slots=slots, min_kv_gib=min_kv,
                                  expert_replicas=replicas)
    return fits, message


@lru_cache(maxsize=256)
def _speedup(key: tuple) -> dict[str, Any] | None:
    from dwdp_runtime.planner import plan

    model, dtype, hw, isl, _min_kv, d, k, s, slots, copt, _replicas = key
    try:
        r = plan(model=model, dtype=dtype, hardware=hw, isl=isl, dwdp_size=d, experts_per_worker=k,
                 prefetch_stride=s, prefetch_slots=slots, contention_opt=copt, with_crossover=False,
                 with_recommendation=False)
    except ValueError:
        return None
    return {"predictedSpeedup": round(float(r.speedup), 4), "tDwdpUs": round(float(r.t_dwdp_us), 1),
            "tDepUs": round(float(r.t_dep_us), 1), "isl": isl}


@register_check
def memory_fit_errors(spec: DwdpGroupSpec) -> list[str]:
    """The planner's memory fit as a ``validate_spec`` rule (only for specs with ``sizing``)."""
    key = _key(spec)
    if key is None:
        return []
    fits, message = _fit(key)
    return [] if fits else [f"spec.sizing: {message}"]


def sizing_status(spec: DwdpGroupSpec) -> dict[str, Any] | None:
    key = _key(spec)
    if key is None:
        return None
    fits, message = _fit(key)
    out: dict[str, Any] = {"fits": fits, "message": message}
    if fits:
        out.update(_speedup(key) or {})
    return out
