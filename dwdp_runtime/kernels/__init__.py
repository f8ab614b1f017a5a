"""DWDP's Triton kernels (bf16 MoE experts on CUDA; Triton's interpreter runs them on CPU for tests).

Modules (each imports triton, so this package imports them lazily — ``import dwdp_runtime.kernels``
works on a machine without triton):

  * ``routing``      — per-expert pair lists padded to the GEMM block (``align_routing``);
  * ``grouped_gemm`` — GEMM 1 (gather in the A-load, act·mul epilogue), GEMM 2 (routing-weight epilogue);
  * ``reduce``       — fixed-order fp32 top-k reduction;
  * ``tuning``       — default tile table, warm-up tuner, per-shape cache (imports without triton);
  * ``moe``          — ``fused_experts`` composing them, ``ExpertsLayout`` / ``ExpertWeights``.

``available(device)`` says whether the kernels can run for tensors on ``device``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

#: activations the GEMM 1 epilogue implements (transformers' ACT2FN names → the kernel's ACT code)
ACTIVATIONS: dict[str, int] = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "relu": 2}

__all__ = ["ACTIVATIONS", "available", "fused_experts", "tune_experts", "ExpertsLayout", "ExpertWeights", "interpreting"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: Any = "cuda") -> bool:
    """Triton is importable and can run on ``device``: a CUDA device, or the CPU under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available()
    return kind == "cpu" and interpreting()


def __getattr__(name: str):
    if name in ("fused_experts", "tune_experts", "ExpertsLayout", "ExpertWeights"):
        from . import moe

        return getattr(moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
