"""One routed-experts forward from FP4 weights, weight-only: align → FP4 GEMM 1 → FP4 GEMM 2 → reduce.

``fp4_experts(hidden [T, H], topk_ids, topk_weights, weights: Fp4Weights, layout)`` is ``moe.fused_experts``
with the weight tiles decoded from packed E2M1 in the kernels' loads (``fp4_grouped_gemm``): the same
routing plan, the same tile config (``tuning.config_for`` keyed by the **activations'** dtype, so the
FP4 and bf16 paths pick the same tiles), the same fixed-order reduction. Output: bitwise
``fused_experts`` on the dequantized weights (``quant.fp4`` in the activations' dtype), at a quarter of
the weight bytes read.

Weights (``Fp4Weights``) as DWDP binds them: packed ``[E, N, K/2]`` (or gpt-oss's ``[E, N, K/32, 16]``)
uint8 per projection, ``[out, in]`` whatever the model's parameter layout; group scales (E8M0 bytes for
MXFP4, float8_e4m3fn for NVFP4); NVFP4's per-projection fp32 globals ``[E, S]``. ``ExpertsLayout``'s
``is_transposed`` does not apply (the packed weights are always ``[out, in]``); ``is_concatenated`` picks
``[gate; up]`` halves or interleaved rows as in the bf16 kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import tuning
from .fp4_grouped_gemm import E4M3, E8M0, fp4_down, fp4_gate_up
from .moe import ExpertsLayout
from .reduce import reduce_topk
from .routing import align_routing
from .support import ACTIVATIONS, interpreting
from .tuning import GemmConfig

#: ``Fp4Weights.format`` values (``dwdp_runtime.quant.QuantFormat`` names) → the kernels' scale format
SCALE_FORMATS = {"mxfp4": E8M0, "fp4-ue8m0": E8M0, "nvfp4": E4M3}


@dataclass(frozen=True)
class Fp4Weights:
    """The two FP4 projections of all E experts (views, never copied)."""

    format: str                             # "mxfp4" | "nvfp4" | "fp4-ue8m0" (DeepSeek-V4: MXFP4's math)
    gate_up: torch.Tensor                   # packed [E, 2I, H/2] (or [E, I, H/2] without a gate)
    gate_up_scale: torch.Tensor             # [E, 2I, H/G]
    down: torch.Tensor                      # packed [E, H, I/2]
    down_scale: torch.Tensor                # [E, H, I/G]
    gate_up_scale_2: torch.Tensor | None = None   # NVFP4: [E, S] fp32 (S = 2 for [gate; up], else 1)
    down_scale_2: torch.Tensor | None = None      # NVFP4: [E, 1]
    gate_up_bias: torch.Tensor | None = None      # [E, 2I]
    down_bias: torch.Tensor | None = None         # [E, H]


#: rows per expert from which the compiled FP4 kernels take their own tiling (``fp4_configs``)
FP4_TILE_MIN_LOAD = 256
#: that tiling, both GEMMs: 128 rows (plan block) × 64 weight rows (gate_up: 64 gate + 64 up) per program,
#: 4 warps, 4 stages — small enough (241 registers, 78 KiB shared in Triton 3.9's sm_90 build) for two programs
#: per SM, so one program's decode runs beside the other's MMA. Measured on an H200 (bench/fp4_moe.py --sweep,
#: 2026-12-04, both formats, both expert shapes, 4K and 16K tokens): the best gate_up everywhere (the bf16
#: 128×128 / 8-warp tiling 13–18 % slower), and for down within 4 % of the best pointer tiling (128×256 / 8 warps:
#: equal on MXFP4, 30–45 % slower on NVFP4; a 256-row block was up to 8 % faster for down alone, but the plan's
#: block is shared and gate_up at 256 rows was 25 % slower). BLOCK_K stays the bf16 kernels' (batch
#: invariance: one K pipeline per weight shape whatever the load)
FP4_TILE = GemmConfig(block_m=128, block_n=64, num_warps=4, num_stages=4)


def fp4_configs(cfg1: GemmConfig, cfg2: GemmConfig, load: int) -> tuple[GemmConfig, GemmConfig]:
    """The two GEMMs' tiles from the bf16 kernels' (``tuning.config_for``): the same under the interpreter (so
    the CPU tests compare bitwise) and below ``FP4_TILE_MIN_LOAD``; ``FP4_TILE`` above it on the GPU."""
    if interpreting() or load < FP4_TILE_MIN_LOAD:
        return cfg1, cfg2
    tile = FP4_TILE if FP4_TILE.block_k == cfg1.block_k == cfg2.block_k else cfg1
    return tile, tile


def _rows(w: torch.Tensor) -> int:
    return w.shape[1]


def fp4_experts(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                weights: Fp4Weights, layout: ExpertsLayout = ExpertsLayout()) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` in ``hidden_states``' dtype (bf16 / fp16 on CUDA)."""
    if weights.format not in SCALE_FORMATS:
        raise ValueError(f"FP4 format {weights.format!r}: one of {sorted(SCALE_FORMATS)}")
    if layout.activation not in ACTIVATIONS:
        raise ValueError(f"activation {layout.activation!r} has no fused epilogue; have {sorted(ACTIVATIONS)}")
    if layout.glu is not None and not layout.has_gate:
        raise ValueError("a clamped gated activation needs gate and up projections (has_gate=False)")
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    num_experts, hidden = weights.gate_up.shape[0], x.shape[1]
    inter = _rows(weights.gate_up) // (2 if layout.has_gate else 1)
    if _rows(weights.down) != hidden:
        raise ValueError(f"FP4 expert weights disagree: gate_up {tuple(weights.gate_up.shape)}, down "
                         f"{tuple(weights.down.shape)}, hidden {hidden}")
    up_offset, col_step = (inter, 1) if layout.is_concatenated else (1, 2)
    load = tuning.load_bucket(x.shape[0], topk_ids.shape[1], num_experts)
    d = str(x.dtype).removeprefix("torch.")
    cfg1 = tuning.config_for(tuning.ShapeKey("gate_up", inter, hidden, num_experts, topk_ids.shape[1], d, load))
    cfg2 = tuning.with_block_m(tuning.config_for(tuning.ShapeKey("down", hidden, inter, num_experts,
                                                                 topk_ids.shape[1], d, load)), cfg1.block_m)
    cfg1, cfg2 = fp4_configs(cfg1, cfg2, load)
    fmt = SCALE_FORMATS[weights.format]
    plan = align_routing(topk_ids, num_experts, cfg1.block_m)
    act = fp4_gate_up(x, weights.gate_up, weights.gate_up_scale, weights.gate_up_scale_2, plan, cfg1, inter=inter,
                      up_offset=up_offset, col_step=col_step, has_gate=layout.has_gate, scale_fmt=fmt,
                      bias=weights.gate_up_bias, activation=layout.activation, glu=layout.glu)
    y = fp4_down(act, weights.down, weights.down_scale, weights.down_scale_2, topk_weights, plan, cfg2,
                 hidden=hidden, scale_fmt=fmt, bias=weights.down_bias)
    return reduce_topk(y, topk_ids, num_experts, out_dtype=x.dtype)
