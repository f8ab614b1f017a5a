"""The CuTe FP8 GEMM's trace build, its host half: the counters' layout, a buffer for them, and their reading.

``_fp8_cute_kernel.BlockScaledGroupedGemm(trace=True)`` (launched by ``fp8_cute`` with a ``trace`` buffer) reads
``clock64`` around each role's waits and epilogue and writes, per CTA and role, ``TRACE_FIELDS`` as int64 SM cycles
(and its tile count). Here, for CPU code as well: ``trace_buffer`` allocates the counters for one launch,
``phase_shares`` turns them into the share of each role's cycles spent waiting and in the epilogue, and
``sm_clock_hz`` into the SM clock the launch ran at (both pure).
Kept apart from ``fp8_cute`` because the kernel module reads the layout too (no import circle).
"""

from __future__ import annotations

import torch

#: the trace build's counters (``_fp8_cute_kernel``'s ``trace``): per CTA, one row per role — the producer warp, math
#: warpgroups 1 and 2 — of SM cycles: the role's whole run, waiting for a stage (the producer: for a free one; a
#: math warpgroup: for a full one), waiting for its own wgmma, in the epilogue; and the tiles it worked
TRACE_ROLE_NAMES = ("producer", "math warpgroup 1", "math warpgroup 2")
TRACE_ROLES = len(TRACE_ROLE_NAMES)
TRACE_FIELDS = ("cycles", "stage_wait", "mma_wait", "epilogue", "tiles")


def trace_buffer(device) -> torch.Tensor:
    """Zeroed counters for one traced launch: ``[SMs, TRACE_ROLES, len(TRACE_FIELDS)]`` int64 (a CTA per SM at
    most: the grid is persistent)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(sms, TRACE_ROLES, len(TRACE_FIELDS), dtype=torch.int64, device=device)


def phase_shares(trace: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per role, the share of its SM cycles spent waiting for a stage, for its own wgmma and in the epilogue, and
    its tiles per CTA — summed over the CTAs that ran (pure: tested on CPU)."""
    counters = trace.detach().to("cpu", torch.float64)
    ran = counters[:, :, 0].sum(dim=1) > 0
    out = {}
    for role, name in enumerate(TRACE_ROLE_NAMES):
        c = counters[ran, role]
        total = float(c[:, 0].sum())
        out[name] = {field: (float(c[:, i].sum()) / total if total else 0.0) for i, field in enumerate(TRACE_FIELDS)
                     if field not in ("cycles", "tiles")}
        out[name]["tiles_per_cta"] = float(c[:, 4].mean()) if len(c) else 0.0
    return out


def sm_clock_hz(trace: torch.Tensor, wall_s: float) -> float:
    """The SM clock a traced launch ran at: its longest role's cycles (``clock64`` counts SM cycles) over the launch's
    wall time (pure). Under FP8 load an H200 runs below its 1.98 GHz boost when it caps its power."""
    return float(trace[..., 0].max()) / wall_s if wall_s > 0 else 0.0
