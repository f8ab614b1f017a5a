"""Clamped gated activations of MoE experts (gpt-oss, DeepSeek-V4) for the grouped GEMMs' fused epilogue.

`transformers` lets an experts class replace ``_apply_gate`` (what runs between GEMM 1 and GEMM 2). Two classes
that matter replace it with a clamped SwiGLU:
  * gpt-oss:      ``g = min(gate, L)``, ``u = clamp(up, −L, L)``, ``g·sigmoid(α·g) · (u + 1)`` (α = 1.702, L = 7;
                  gate and up interleaved ``g0 u0 g1 u1 …``);
  * DeepSeek-V4:  ``silu(min(gate, L)) · clamp(up, −L, L)`` (``[gate; up]`` halves).
Both are ``ClampedGlu(limit=L, alpha=α, up_shift=s)``: ``g·sigmoid(α·g) · (u + s)``, silu being α = 1.

``match(module, concatenated)`` decides from behaviour, not from the class name: it evaluates the module's own
``_apply_gate`` on a probe that crosses ±L (and values near 0) and keeps the candidate built from the module's
``limit`` / ``alpha`` attributes whose ``reference`` agrees within ``MATCH_RTOL``; a gate that agrees with none
stays on `transformers`' forward (the caller's refusal names it). ``reference`` is the torch form the tests and
the match compare against; the kernels compute the same expression on the fp32 accumulators (``grouped_gemm._glu``)
and round once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: agreement the match asks of a candidate on the probe (fp32: the orders of a few ops may differ by an ulp)
MATCH_RTOL = 1e-5
#: probe columns per half (gate, up); values span ±3·limit with ±limit itself and values around 0 included
PROBE_WIDTH = 64


@dataclass(frozen=True)
class ClampedGlu:
    """``g·sigmoid(alpha·g) · (u + up_shift)`` with ``g = min(gate, limit)``, ``u = clamp(up, −limit, limit)``."""

    limit: float
    alpha: float = 1.0
    up_shift: float = 0.0


def reference(gate: torch.Tensor, up: torch.Tensor, glu: ClampedGlu) -> torch.Tensor:
    """The activation in torch, in the operands' dtype (the kernels: fp32 accumulators, one rounding after)."""
    g = gate.clamp(max=glu.limit)
    u = up.clamp(min=-glu.limit, max=glu.limit)
    return g * torch.sigmoid(g * glu.alpha) * (u + glu.up_shift)


def split(gate_up: torch.Tensor, concatenated: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of GEMM 1's output: ``[gate; up]`` halves or interleaved columns."""
    if concatenated:
        half = gate_up.shape[-1] // 2
        return gate_up[..., :half], gate_up[..., half:]
    return gate_up[..., ::2], gate_up[..., 1::2]


def _probe(limit: float) -> torch.Tensor:
    """``[2, 2·PROBE_WIDTH]`` fp32 values crossing ±limit, both halves varied independently."""
    span = torch.linspace(-3 * abs(limit), 3 * abs(limit), PROBE_WIDTH)
    span[:4] = torch.tensor([limit, -limit, 0.0, 0.5])
    return torch.stack([torch.cat([span, span.flip(0)]), torch.cat([span.flip(0) * 0.7, span * 1.3])])


def match(module, concatenated: bool) -> ClampedGlu | None:
    """The ``ClampedGlu`` the module's ``_apply_gate`` computes (module docstring), or None."""
    limit = getattr(module, "limit", None)
    if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not limit > 0:
        return None
    alpha = getattr(module, "alpha", 1.0)
    alphas = {float(alpha), 1.0} if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else {1.0}
    probe = _probe(float(limit))
    try:
        with torch.no_grad():
            got = module._apply_gate(probe)
    except Exception:  # noqa: BLE001 - a gate that cannot run on the probe is not one we can fuse
        return None
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != (2, PROBE_WIDTH):
        return None
    gate, up = split(probe, concatenated)
    for a in sorted(alphas):
        for shift in (0.0, 1.0):
            glu = ClampedGlu(float(limit), a, shift)
            if torch.allclose(got.float(), reference(gate, up, glu), rtol=MATCH_RTOL, atol=MATCH_RTOL):
                return glu
    return None
