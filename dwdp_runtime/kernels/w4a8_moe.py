"""FP4 experts, W4A8: the packed FP4 composites re-encoded to e4m3 blocks, then the FP8 block-scaled MoE.

``w4a8_experts(hidden, topk_ids, topk_weights, weights: Fp4Weights, layout)`` = ``fp8_moe.fp8_moe_forward`` on
``fp4_fp8.fp4_block_fp8`` of both projections: activations quantized per token and 128-column group (e4m3),
e4m3 × e4m3 MMAs with fp32 promotion every 128-deep K step — on sm_90 the CuTe DSL warp-specialised kernels
(``fp8_cute``), elsewhere the Triton ones. What stays FP4: the page pool and every byte the prefetch moves
(a quarter of bf16); the e4m3 copy of the layer is made after its pull, for its forward, and freed to the
caching allocator. A layer whose experts would need more than ``quant.memory.W4A8_SCRATCH_BUDGET`` (1 GiB) in e4m3
is re-encoded and multiplied in chunks of experts (``chunked_forward``: each GEMM launch skips the other chunks'
blocks of the routing plan), so the scratch is bounded (``scratch_bytes``, which ``dwdp plan`` counts) —
DeepSeek-R1: 1 GiB instead of 11.3 GB per layer.

``Fp4Kernel`` (``DWDP_FP4_KERNEL``) picks the FP4 path on CUDA: ``weight-only`` (``fp4_moe``: exact, the
dequantized model's numbers bit for bit), ``w4a8`` (this module; refused with the reason where it cannot run),
``auto`` (the default: W4A8 where ``unsupported`` finds nothing and the weights' format is in
``W4A8_AUTO_FORMATS``, weight-only elsewhere). The choice depends on the checkpoint, the machine and the
variable, never on the batch; both paths are batch invariant (no split-K, fixed-order reduce).

Which FP8 kernels: the CuTe ones (``chunked_forward``) where they can take the experts (``cute_unsupported``:
no biases, widths that are multiples of 128, a clamped SwiGLU only in their fused gate_up — DeepSeek-V4's — and
that one only when ``DWDP_FP8_BACKEND=cute`` asks: ``cute_refusal``; its clamped epilogue is compiled and checked
on CPU but has not run on a GPU, so ``auto`` keeps the Triton kernels that have), else the Triton ones
(``triton_chunked_forward``),
whose epilogues add the biases (GEMM 1's before the activation, in the checkpoint's row order — gpt-oss's
interleaved pairs read with a stride of 2 — and GEMM 2's before the routing weight) and compute the clamped
SwiGLU of gpt-oss and DeepSeek-V4 (``gates.ClampedGlu``, the bf16 kernels' ``grouped_gemm._glu``), and whose
masks take ragged widths (gpt-oss's 2880 = 22.5 blocks). Either way the re-encoding writes gate rows then up rows
(``fp4_fp8.gate_up_block_fp8``: interleaved rows are read apart), in chunks of experts within the budget.

What W4A8 cannot run (``unsupported``): no CUDA, and a GPU where the compiled re-encoding does not write torch's
bytes (``fp4_fp8.self_check``, once per process at the warm-up forward).
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from ..contract import Fp4Kernel, TuningEnv, tuning_choice
from ..quant.scheme import FP8_SCALE_BLOCK
from ..quant.memory import W4A8_SCRATCH_BUDGET, w4a8_chunk_experts, w4a8_projections
from ..quant.memory import w4a8_scratch_bytes as scratch_bytes  # noqa: F401 - re-exported: the scratch's size
from .fp4_fp8 import fp4_block_fp8, gate_up_block_fp8, self_check, unpacked_columns
from .fp4_moe import SCALE_FORMATS, Fp4Weights
from .moe import ExpertsLayout
from .support import log_choice_once

log = logging.getLogger(__name__)


#: environment variable choosing the FP4 experts path on CUDA (module docstring)
KERNEL_ENV = str(TuningEnv.FP4_KERNEL)
#: formats ``auto`` runs as W4A8. MXFP4's re-encoding is lossless for every group within 14 binades of its
#: 128×128 block's largest (``fp4_fp8``), so W4A8 differs from weight-only by the activations' e4m3 rounding
#: alone; NVFP4's values have up to 6 significant bits and round to e4m3's 4 on top (docs/KERNELS.md, W4A8:
#: the model-level agreement decides)
W4A8_AUTO_FORMATS = ("mxfp4", "fp4-ue8m0", "nvfp4")


def wanted_kernel() -> Fp4Kernel:
    return tuning_choice(TuningEnv.FP4_KERNEL, Fp4Kernel, Fp4Kernel.AUTO)


def unsupported(weights: Fp4Weights, layout: ExpertsLayout, device: torch.device) -> str | None:
    """Why W4A8 cannot run these experts here (None when it can)."""
    if device.type != "cuda":
        return f"W4A8 runs on CUDA devices (the weights are on {device})"
    if weights.format not in SCALE_FORMATS:
        return f"FP4 format {weights.format!r}"
    return self_check(device).unusable


def cute_unsupported(weights: Fp4Weights, layout: ExpertsLayout) -> str | None:
    """Why the CuTe FP8 kernels cannot take these experts (the Triton ones then do; None when they can): their
    epilogues have no bias, a clamped SwiGLU only in the fused gate_up (DeepSeek-V4's), and their tiles no ragged
    edge."""
    from .fp8_cute import FUSED_ACTIVATIONS

    if weights.gate_up_bias is not None or weights.down_bias is not None or layout.has_bias:
        return "expert biases"
    if layout.glu is not None and not (layout.has_gate and layout.activation in FUSED_ACTIVATIONS):
        return f"a clamped {layout.activation} outside the fused gate_up"
    hidden, inter = unpacked_columns(weights.gate_up), _inter(weights)
    if hidden % FP8_SCALE_BLOCK or inter % FP8_SCALE_BLOCK:
        return f"hidden {hidden} / intermediate {inter} not multiples of {FP8_SCALE_BLOCK}"
    return None


#: why ``auto`` keeps a clamped SwiGLU off the CuTe kernels (module docstring)
CLAMP_OPT_IN = ("clamped SwiGLU unless DWDP_FP8_BACKEND=cute (their clamped epilogue compiles and matches the "
                "block math on CPU but is not yet measured on a GPU)")


def cute_refusal(weights: Fp4Weights, layout: ExpertsLayout, wanted) -> str | None:
    """Why these experts stay off the CuTe kernels under ``wanted`` (an ``fp8_moe.Fp8Backend``): what they cannot
    take (``cute_unsupported``), or a clamped SwiGLU that only an explicit ``cute`` sends there (None: they go)."""
    from .fp8_moe import Fp8Backend

    why = cute_unsupported(weights, layout)
    if why is None and layout.glu is not None and wanted is not Fp8Backend.CUTE:
        return CLAMP_OPT_IN
    return why


def chosen_kernel(weights: Fp4Weights, layout: ExpertsLayout, device: torch.device) -> Fp4Kernel:
    """WEIGHT_ONLY or W4A8 for these experts (``KERNEL_ENV``; module docstring)."""
    wanted = wanted_kernel()
    if wanted is Fp4Kernel.WEIGHT_ONLY:
        return wanted
    why = unsupported(weights, layout, device)
    if why and wanted is Fp4Kernel.W4A8:
        raise RuntimeError(f"{KERNEL_ENV}=w4a8 but W4A8 cannot run these FP4 experts: {why}")
    if why is None and weights.format not in W4A8_AUTO_FORMATS:
        why = f"{weights.format} runs weight-only unless {KERNEL_ENV}=w4a8"
    chosen = Fp4Kernel.WEIGHT_ONLY if why else Fp4Kernel.W4A8
    log_choice_once(log, "FP4 experts", chosen.value, why)
    return chosen


def _inter(weights: Fp4Weights) -> int:
    return unpacked_columns(weights.down)


def w4a8_experts(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 weights: Fp4Weights, layout: ExpertsLayout = ExpertsLayout(),
                 budget: int = W4A8_SCRATCH_BUDGET) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` through W4A8 (module docstring), in chunks of experts of at most
    ``budget`` re-encoded bytes: on the CuTe kernels (``chunked_forward``) where they run and take these experts,
    else on the Triton FP8 kernels (``triton_chunked_forward``: no sm_90 or no CuTe DSL, biases, ragged widths
    — gpt-oss's —, and the CPU tests under the interpreter)."""
    from . import fp8_cute
    from .fp8_moe import wanted_backend

    wanted = wanted_backend()
    why = cute_refusal(weights, layout, wanted)
    if why is None and _on_cute(hidden_states.device, wanted):
        gemm = functools.partial(fp8_cute.block_scaled_grouped_gemm, out_dtype=torch.bfloat16)
        from .w4a8_reencode import CudaStreamOps, overlap_wanted

        ops = CudaStreamOps(hidden_states.device) if overlap_wanted() else None
        try:
            return chunked_forward(hidden_states, topk_ids, topk_weights, weights, layout, gemm=gemm,
                                   fused_gemm1=fp8_cute.gate_up_act_quant, budget=budget, ops=ops)
        except fp8_cute.CuteBuildError:
            # recorded by fp8_cute: a forced ``cute`` backend now refuses with the reason, ``auto`` takes Triton
            # (once per process, at the warm-up forward, as for FP8 checkpoints)
            if _on_cute(hidden_states.device, wanted):
                raise
    elif why is not None and hidden_states.device.type == "cuda":
        log_choice_once(log, "W4A8 FP4 experts", "on the Triton FP8 kernels", f"the CuTe ones take no {why}")
    return triton_chunked_forward(hidden_states, topk_ids, topk_weights, weights, layout, budget=budget)


def _on_cute(device: torch.device, wanted) -> bool:
    """Whether the re-encoded weights (contiguous, 128-multiples by construction) run on the CuTe kernels here
    under ``wanted`` (``DWDP_FP8_BACKEND``, as for FP8 checkpoints: ``cute`` where they cannot run is an error
    naming why)."""
    from . import fp8_cute
    from .fp8_moe import BACKEND_ENV, Fp8Backend

    if wanted is Fp8Backend.TRITON or device.type != "cuda":
        return False
    why = fp8_cute.unavailable(device)
    if why and wanted is Fp8Backend.CUTE:
        raise RuntimeError(f"{BACKEND_ENV}=cute but the CuTe FP8 kernels cannot run: {why}")
    return why is None


def expert_chunks(num_experts: int, expert_bytes: int, budget: int) -> list[tuple[int, int]]:
    """``[c0, c1)`` ranges of experts re-encoded together (``quant.memory.w4a8_chunk_experts`` per chunk)."""
    step = w4a8_chunk_experts(num_experts, expert_bytes, budget)
    return [(c0, min(num_experts, c0 + step)) for c0 in range(0, num_experts, step)]


def chunk_block_map(block_expert: torch.Tensor, c0: int, c1: int, num_experts: int) -> torch.Tensor:
    """The plan's block map for one chunk: experts ``[c0, c1)`` renumbered from 0, every other block idle (-1)
    — the GEMMs skip idle blocks, so each launch multiplies only its chunk's rows (no host synchronisation)."""
    if (c0, c1) == (0, num_experts):
        return block_expert
    inside = (block_expert >= c0) & (block_expert < c1)
    return torch.where(inside, block_expert - c0, torch.full_like(block_expert, -1))


def _steps(num_experts: int, gate_up_bytes: int, down_bytes: int, budget: int, ahead: bool) -> list:
    """The chunks in order: gate_up's, then down's. Ahead of the GEMMs (``w4a8_reencode.AheadReencoder``) two
    slots share the budget and each projection is cut in ``AHEAD_CHUNKS`` chunks at least."""
    from .w4a8_reencode import AHEAD_CHUNKS, Step

    steps = []
    for projection, each in (("gate_up", gate_up_bytes), ("down", down_bytes)):
        if ahead:
            per = min(w4a8_chunk_experts(num_experts, each, budget // 2), -(-num_experts // AHEAD_CHUNKS))
            chunks = [(c0, min(num_experts, c0 + per)) for c0 in range(0, num_experts, per)]
        else:
            chunks = expert_chunks(num_experts, each, budget)
        steps += [Step(projection, c0, c1) for c0, c1 in chunks]
    return steps


def _reencoder(steps: list, weights: Fp4Weights, layout: ExpertsLayout, device: torch.device, ops):
    """The re-encoder for these chunks: in line, or (``ops``: ``w4a8_reencode.StreamOps``) one chunk ahead."""
    from .w4a8_reencode import AheadReencoder, InlineReencoder

    inter = _inter(weights)
    sources = {"gate_up": (weights.gate_up, weights.gate_up_scale, weights.gate_up_scale_2,
                           inter if layout.has_gate else None),
               "down": (weights.down, weights.down_scale, weights.down_scale_2, None)}

    def encode(step, out):
        packed, scales, globals_, split = sources[step.projection]
        chunk = (packed[step.c0:step.c1], scales[step.c0:step.c1], weights.format,
                 None if globals_ is None else globals_[step.c0:step.c1])
        if split is None:
            return fp4_block_fp8(*chunk, out=out)
        return gate_up_block_fp8(*chunk, inter=split, interleaved=not layout.is_concatenated, out=out)

    if ops is None:
        return InlineReencoder(steps, encode)

    def shape(step):
        packed = sources[step.projection][0]
        return step.c1 - step.c0, packed.shape[1], unpacked_columns(packed)

    def views(step, slot):   # the CuTe path's shapes: multiples of 128 (``cute_unsupported``)
        e, n, k = shape(step)
        return (slot[0][:e * n * k].view(torch.float8_e4m3fn).view(e, n, k),
                slot[1][:e * (n // FP8_SCALE_BLOCK) * (k // FP8_SCALE_BLOCK)].view(e, n // FP8_SCALE_BLOCK, k // FP8_SCALE_BLOCK))

    most_w = max(e * n * k for e, n, k in map(shape, steps))
    most_s = max(e * (n // FP8_SCALE_BLOCK) * (k // FP8_SCALE_BLOCK) for e, n, k in map(shape, steps))
    slots = [(torch.empty(most_w, dtype=torch.uint8, device=device),
              torch.empty(most_s, dtype=torch.float32, device=device)) for _ in range(2)]
    return AheadReencoder(steps, encode, slots, views, ops)


def chunked_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    weights: Fp4Weights, layout: ExpertsLayout, *, gemm, fused_gemm1=None,
                    budget: int = W4A8_SCRATCH_BUDGET, ops=None) -> torch.Tensor:
    """W4A8 over plan rows (``fp8_cute.plan_rows_moe_forward``'s passes) with the re-encoding in chunks of experts:
    ``gemm(a, sa, w, ws, block_expert, out=d)`` and ``fused_gemm1(a, sa, w1, s1, block_expert, inter, out=(h, hs),
    glu=layout.glu)``
    have the CuTe GEMMs' contract (idle blocks skipped, ``out`` written only at the live blocks; the CPU tests pass
    the torch block math). Each projection is re-encoded in chunks of experts, so at most ``budget`` bytes of
    e4m3 are held (``quant.memory.w4a8_scratch_bytes``); ``ops`` (``w4a8_reencode.StreamOps``): each chunk is
    re-encoded one ahead on a side stream (``AheadReencoder``), else in line. Outputs are the same bits in one
    chunk or many, in line or ahead."""
    from .fp8_cute import FUSED_ACTIVATIONS, TILE_M
    from .fp8_plan_rows import act_quant_plan_rows, gather_plan_rows, reduce_plan_rows
    from .fp8_quant import quantize_groups
    from .routing import align_routing

    out_dtype = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    num_experts, hidden, inter = weights.gate_up.shape[0], hidden_states.shape[1], _inter(weights)
    device = hidden_states.device
    xq, xs = quantize_groups(hidden_states)
    plan = align_routing(topk_ids, num_experts, TILE_M)
    a, sa = gather_plan_rows(xq, xs, plan)
    rows = a.shape[0]
    fused = fused_gemm1 is not None and layout.has_gate and layout.activation in FUSED_ACTIVATIONS
    steps = _steps(num_experts, *w4a8_projections(hidden, inter, layout.has_gate), budget, ops is not None)
    chunks = _reencoder(steps, weights, layout, device, ops)
    first_down = next(n for n, step in enumerate(steps) if step.projection == "down")

    def multiply(n: int, run) -> None:   # chunk n's GEMM on its re-encoded weights
        w, ws = chunks.take(n)
        run(w, ws, chunk_block_map(plan.block_expert, steps[n].c0, steps[n].c1, num_experts))
        chunks.done(n)   # in line: its weights go back to the allocator when ``w``, ``ws`` do, here

    if layout.glu is not None and not fused:
        raise ValueError("a clamped SwiGLU runs in the fused gate_up only (cute_unsupported)")
    if fused:
        h = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=device)
        hs = torch.empty(inter // 128, rows, dtype=torch.float32, device=device)
        for n in range(first_down):
            multiply(n, lambda w, ws, blocks: fused_gemm1(a, sa, w, ws, blocks, inter, out=(h, hs),
                                                          glu=layout.glu))
    else:
        gate_up = torch.empty(rows, weights.gate_up.shape[1], dtype=torch.bfloat16, device=device)
        for n in range(first_down):
            multiply(n, lambda w, ws, blocks: gemm(a, sa, w, ws, blocks, out=gate_up))
        h, hs = act_quant_plan_rows(gate_up, plan, inter, has_gate=layout.has_gate, activation=layout.activation)
        del gate_up
    y = torch.empty(rows, hidden, dtype=torch.bfloat16, device=device)
    for n in range(first_down, len(steps)):
        multiply(n, lambda w, ws, blocks: gemm(h, hs, w, ws, blocks, out=y))
    chunks.finish()
    out = reduce_plan_rows(y, plan, topk_weights, out_dtype=out_dtype)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def triton_chunked_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                           weights: Fp4Weights, layout: ExpertsLayout, *, budget: int = W4A8_SCRATCH_BUDGET
                           ) -> torch.Tensor:
    """W4A8 on the Triton FP8 kernels (``fp8_grouped_gemm``) with the re-encoding in chunks of experts, in line:
    one routing plan; each chunk's GEMM launch skips the other chunks' blocks (``chunk_block_map``) and writes its
    own rows of the shared intermediate (e4m3 + scales) or output. The biases (their chunk's rows, any strides)
    and the clamped gate go to the kernels' epilogues. The same bits in one chunk or many, and whatever the batch
    (``fp8_moe.ROW_BLOCK``)."""
    from .fp8_grouped_gemm import fp8_down, fp8_gate_up
    from . import tuning
    from .fp8_moe import default_configs
    from .fp8_quant import quantize_groups
    from .reduce import reduce_topk
    from .routing import align_routing

    out_dtype = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    num_experts, hidden, inter = weights.gate_up.shape[0], hidden_states.shape[1], _inter(weights)
    device = hidden_states.device
    cfg1, cfg2 = default_configs(tuning.load_bucket(hidden_states.shape[0], topk_ids.shape[1], num_experts), hidden)
    xq, xs = quantize_groups(hidden_states)
    plan = align_routing(topk_ids, num_experts, cfg1.block_m)
    rows = plan.sorted_pairs.numel()
    act = (torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=device),
           torch.empty(rows, -(-inter // FP8_SCALE_BLOCK), dtype=torch.float32, device=device))
    y = torch.empty(plan.num_pairs, hidden, dtype=out_dtype, device=device)
    steps = _steps(num_experts, *w4a8_projections(hidden, inter, layout.has_gate), budget, False)
    chunks = _reencoder(steps, weights, layout, device, None)
    for n, step in enumerate(steps):
        w, ws = chunks.take(n)
        chunk_plan = dataclasses.replace(plan, block_expert=chunk_block_map(plan.block_expert, step.c0, step.c1,
                                                                            num_experts))
        if step.projection == "gate_up":
            bias = None if weights.gate_up_bias is None else weights.gate_up_bias[step.c0:step.c1]
            fp8_gate_up(xq, xs, w, ws, chunk_plan, cfg1, inter=inter, up_srow=-(-inter // FP8_SCALE_BLOCK),
                        has_gate=layout.has_gate, activation=layout.activation, bias=bias,
                        bias_interleaved=not layout.is_concatenated, glu=layout.glu, out=act)
        else:
            bias = None if weights.down_bias is None else weights.down_bias[step.c0:step.c1]
            fp8_down(act[0], act[1], w, ws, topk_weights, chunk_plan, cfg2, hidden=hidden, out_dtype=out_dtype,
                     bias=bias, out=y)
        chunks.done(n)
    chunks.finish()
    out = reduce_topk(y, topk_ids, num_experts, out_dtype=out_dtype)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)
