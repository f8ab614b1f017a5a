"""DWDP's GPU kernels (Triton, and CuTe DSL for the FP8 GEMMs on sm_90); Triton's interpreter runs the Triton ones on
CPU for tests, and the CuTe ones compile for sm_90a without a GPU.

Each kernel module imports triton (or cutlass), so this package imports them lazily — ``import dwdp_runtime.kernels``
works on a machine without either. By job:

  bf16 experts
  * ``routing``      — per-expert pair lists padded to the GEMM block (``align_routing``);
  * ``grouped_gemm`` — GEMM 1 (gather in the A-load, act·mul epilogue), GEMM 2 (routing-weight epilogue);
  * ``reduce``       — fixed-order fp32 top-k reduction;
  * ``moe``          — ``fused_experts`` composing them, ``ExpertsLayout`` / ``ExpertWeights``;
  * ``gates``        — clamped gated activations (gpt-oss, DeepSeek-V4) for the GEMMs' fused epilogues;
  * ``router``       — the fused router: gate logits → top-k → weights and the alignment's counts in one launch;
  * ``tuning``       — default tile table, warm-up tuner, per-shape cache (imports without triton);
  FP8 experts and linears (128×128 weight blocks, 1×128 activation groups)
  * ``fp8_quant``        — e4m3 activation quantization per token and 128-column group;
  * ``fp8_grouped_gemm`` — the two Triton FP8 grouped GEMMs on the composite views; ``fp8_moe`` — one FP8 experts
                           forward (quantize → align → GEMM 1 → GEMM 2 → reduce), choosing the backend;
  * ``fp8_cute``         — the CuTe DSL path for sm_90 (``_fp8_cute_kernel``: the warp-specialised grouped GEMM,
                           ``_fp8_cute_steps``: its mainloop and epilogue steps, ``fp8_plan_rows``: the Triton passes
                           around its two GEMMs, ``fp8_cute_trace``: its counters, for profiling);
  * ``fp8_linear``       — a dense FP8 block-scaled linear on the CuTe GEMM;
  FP4 experts
  * ``fp4_grouped_gemm``, ``fp4_moe`` — weight-only: MXFP4 / NVFP4 decoded to bf16 in the weight load;
  * ``fp4_fp8``, ``w4a8_moe``, ``w4a8_reencode`` — W4A8: the packed experts re-encoded to e4m3 blocks after the pull,
                       then the FP8 path; where the re-encoding runs (in line, or a chunk ahead on a side stream);
  batch-invariant serving (``--batch-invariant``)
  * ``batch_invariant`` — routes the dense GEMMs through ``bi_matmul`` (``bi_matmul_tma``: its TMA form,
                          ``bi_tiling``: the tiling and arithmetic they share);
  non-expert layers
  * ``rmsnorm``      — one-pass RMSNorm (``rms_norm``), ``rope`` — one-launch q/k rotary embedding
                       (``apply_rope``); swapped into models by ``worker/dwdp_worker/model/layers_impl.py``;
  shared
  * ``_cast``        — fp32 → output dtype in an epilogue, round-to-nearest-even on the GPU and the interpreter alike;
  * ``support``      — the triton-free facts the kernel modules share (activations, interpreter, ``available``).

``available(device)`` says whether the kernels can run for tensors on ``device``; ``support`` lets none of them
import this package back.
"""

from __future__ import annotations

from .support import ACTIVATIONS, available, interpreting

__all__ = ["ACTIVATIONS", "available", "fused_experts", "tune_experts", "ExpertsLayout", "ExpertWeights", "interpreting"]


def __getattr__(name: str):
    if name in ("fused_experts", "tune_experts", "ExpertsLayout", "ExpertWeights"):
        from . import moe

        return getattr(moe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
