"""DWDP's Triton kernels (bf16 MoE experts and the fused non-expert layers on CUDA; Triton's interpreter runs
them on CPU for tests).

Modules (each imports triton, so this package imports them lazily — ``import dwdp_runtime.kernels``
works on a machine without triton):

  * ``routing``      — per-expert pair lists padded to the GEMM block (``align_routing``);
  * ``grouped_gemm`` — GEMM 1 (gather in the A-load, act·mul epilogue), GEMM 2 (routing-weight epilogue);
  * ``reduce``       — fixed-order fp32 top-k reduction;
  * ``tuning``       — default tile table, warm-up tuner, per-shape cache (imports without triton);
  * ``moe``          — ``fused_experts`` composing them, ``ExpertsLayout`` / ``ExpertWeights``;
  * ``fp4_grouped_gemm``, ``fp4_moe`` — the weight-only FP4 variant (MXFP4 / NVFP4 decoded to bf16 in the
                       weight load; ``fp4_experts``, bitwise ``fused_experts`` on the dequantized weights);
  * ``rmsnorm``      — one-pass RMSNorm (``rms_norm``), ``rope`` — one-launch q/k rotary embedding
                       (``apply_rope``); swapped into models by ``worker/dwdp_worker/model/layers_impl.py``.

``available(device)`` says whether the kernels can run for tensors on ``device`` (``support``: the
triton-free facts the kernel modules share, so none of them imports this package back).
"""

from __future__ import annotations

from .support import ACTIVATIONS, available, interpreting

__all__ = ["ACTIVATIONS", "available", "fused_experts", "tune_experts", "ExpertsLayout", "ExpertWeights", "interpreting"]


def __getattr__(name: str):
    if name in ("fused_experts", "tune_experts", "ExpertsLayout", "ExpertWeights"):
        from . import moe

        return getattr(moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
