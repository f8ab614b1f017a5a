"""The CuTe DSL FP8 MoE path for sm_90: warp-specialised block-scaled grouped GEMMs (``_fp8_cute_kernel``).

``cute_fp8_moe_forward`` has ``fp8_moe.fp8_moe_forward``'s contract (same operands: e4m3 weights with 128×128
fp32 block scales as the composites bind them, activations quantized per token and 128-column group), in a
fixed sequence of launches without host synchronisation:

  quantize (``fp8_quant``) → plan (``routing``, 128-row blocks) → gather into plan rows (``fp8_plan_rows``) →
  GEMM 1 fused with SiLU·mul and the e4m3 requantisation (``gate_up_act_quant``; other activations: GEMM 1
  with bf16 ``[rows, 2I]`` out + ``act_quant_plan_rows``) → GEMM 2 (``[rows, H]`` bf16) → routing-weighted
  fixed-order reduce (``fp8_plan_rows``).

Why a second path beside the Triton one: the block-scaled product must be promoted into fp32 every 128-deep
K step, and Triton on sm_90 waits for each step's MMA before the promotion inside a program; the CuTe kernel
runs a producer warp and two math warpgroups per SM, so one warpgroup's promotion overlaps the other's MMA.
Numerics: each K step's product is the same e4m3 MMA and fp32 promotion ``acc += part · (s_a · s_w)``; the
fused GEMM 1 requantises from fp32 as the Triton one does; GEMM 2's output is rounded to bf16 before the
routing weight (the Triton path weights first). Measured on H200 the paths differ by 0.29 % of the output's
mean magnitude (1.1 % with the unfused GEMM 1, whose bf16 intermediate moves e4m3 roundings);
tests/gpu/test_fp8_cute_gpu.py bounds both; model-level top-1 agreement is unchanged within its noise
(docs/MODELS.md). The path itself is deterministic and batch invariant (no split-K, no atomics, fixed-order
reduce).

Requirements (``unavailable()`` / ``unusable()`` name the one that fails): ``nvidia-cutlass-dsl`` and
``cuda-python`` importable, an sm_90 GPU, H and I multiples of 128, K-contiguous experts on 16-byte
boundaries (TMA). Compiled once per (output dtype, tile, K, fused) per process (0.5-1 s at the first
forward); rows, N, E and strides are dynamic.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import re
from dataclasses import dataclass

import torch

from ..quant.scheme import FP8_SCALE_BLOCK
from ..contract import TuningEnv
from .fp8_plan_rows import act_quant_plan_rows, gather_plan_rows, reduce_plan_rows
from .fp8_cute_trace import TRACE_FIELDS, TRACE_ROLES
from .fp8_quant import quantize_groups
from .gates import ClampedGlu
from .routing import align_routing

log = logging.getLogger(__name__)

#: rows per GEMM tile (two math warpgroups × 64): the routing plan is padded to it
TILE_M = 128
#: the fused gate_up's column tile: one 128-column activation group (its gate and up rows in one CTA)
TILE_N_FUSED = 128
#: compute capability the kernel is written for (wgmma, TMA, setmaxnreg)
SM90 = (9, 0)


@dataclass(frozen=True)
class CuteGemmConfig:
    """The kernel's tile width (64, 128, or 256: two 128-column weight tiles per stage into two accumulators,
    used where N is a multiple of 256, else 128), the persistent scheduler's raster order (along N keeps one row
    block's A tiles in L2 while every column tile of its expert passes; along M keeps one weight tile) and the
    cluster width along N (2: two CTAs on adjacent column tiles of one row block share its A tile by TMA
    multicast, halving A's L2 → SM traffic; used where the column tiles pair up, else 1)."""

    tile_n: int = 128
    raster_along_m: bool = False
    swizzle: int = 1
    cluster_n: int = 2


#: the plain GEMMs' default (GEMM 2, and GEMM 1 where it is not fused): 256-column tiles, no cluster — on H200
#: (2026-12-01, bench/fp8_moe.py) GEMM 2 ran 5-9 % faster than at 128 × cluster 2 at DeepSeek-V3's shape (N 7168),
#: the same at Qwen3's; where N is not a multiple of 256, ``_check_operands`` takes 128
PLAIN_CONFIG = CuteGemmConfig(tile_n=256, cluster_n=1)
#: the fused gate_up's: one 128-column activation group per CTA (its gate and up tiles already make it two B tiles
#: wide), clusters of two sharing the A tile
FUSED_CONFIG = CuteGemmConfig()


def unusable(w1: torch.Tensor, w2: torch.Tensor) -> str | None:
    """Why these expert weights cannot take the CuTe path here (None when they can)."""
    why = unavailable(w1.device)
    if why:
        return why
    for name, w in (("gate_up", w1), ("down", w2)):
        if w.shape[1] % FP8_SCALE_BLOCK or w.shape[2] % FP8_SCALE_BLOCK:
            return f"{name} weights {tuple(w.shape)} are not multiples of {FP8_SCALE_BLOCK}"
        if w.stride(2) != 1 or (w.stride(0) * w.element_size()) % TMA_ALIGN or w.data_ptr() % TMA_ALIGN:
            return f"{name} weights are not K-contiguous with 16-byte aligned experts (TMA)"
    return None


class CuteBuildError(RuntimeError):
    """The CuTe kernels could not be built in this process (the kernel module's import or ``cute.compile``
    failed: a CuTe DSL release without an API the kernel uses, a ptxas error, a wrong ``CUTE_DSL_ARCH``). Raised
    by the launch that tried; from then on ``unavailable()`` names the reason, so the ``auto`` backend serves on
    the Triton kernels and a forced ``cute`` one refuses with it."""


#: why the CuTe kernels failed to build in this process (empty: they have not) — process-wide, like ``_COMPILED``
_BUILD_FAILURE: list[str] = []


def _record_build_failure(exc: BaseException) -> CuteBuildError:
    """Remember (the first time) and log why the build failed; the error to raise."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # the DSL colours its diagnostics
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    if not _BUILD_FAILURE:
        _BUILD_FAILURE.append(f"the CuTe FP8 kernels failed to build: {type(exc).__name__}: {first}")
        log.warning("%s; FP8 experts fall back to the Triton kernels unless %s=cute", _BUILD_FAILURE[0],
                    TuningEnv.FP8_BACKEND)
    return CuteBuildError(_BUILD_FAILURE[0])


def unavailable(device=None) -> str | None:
    """Why the CuTe path cannot run here, or None when it can (decided once per process and device: the
    experts forward asks on every layer of every forward; a build failure, once seen, stays the reason)."""
    if _BUILD_FAILURE:
        return _BUILD_FAILURE[0]
    if not torch.cuda.is_available():
        return _machine_reason(-1)
    index = torch.device(device).index if device is not None and torch.device(device).type == "cuda" else None
    return _machine_reason(torch.cuda.current_device() if index is None else index)


@functools.cache
def _machine_reason(index: int) -> str | None:
    for module, package in (("cutlass", "nvidia-cutlass-dsl"), ("cuda.bindings", "cuda-python")):
        try:
            if importlib.util.find_spec(module) is None:
                return f"{package} is not installed"
        except (ImportError, ValueError):
            return f"{package} is not installed"
    if index < 0:
        return "no CUDA device"
    cc = torch.cuda.get_device_capability(index)
    if cc != SM90:
        return f"the CuTe FP8 kernel targets sm_90 (wgmma/TMA), this device is sm_{cc[0]}{cc[1]}"
    return None


@functools.cache
def _kernel_module():
    try:
        from . import _fp8_cute_kernel
    except Exception as exc:  # noqa: BLE001 - any import-time failure of the DSL (missing API, broken install)
        raise _record_build_failure(exc) from exc
    return _fp8_cute_kernel


def compile_gemm(k_tiles: int, cfg: CuteGemmConfig, act_inter: int, args: tuple, n: int, n_out: int,
                 max_active_clusters: int, stream, trace: bool = False, glu: ClampedGlu | None = None):
    """``cute.compile`` of the grouped GEMM for these operands (``gemm_arguments``) and output width ``n_out``
    of weights with ``n`` rows (``trace``: the build with phase counters; ``glu``: the fused gate_up's clamped
    SwiGLU); a failure is recorded and raised as ``CuteBuildError`` (what follows from it: that class's
    docstring)."""
    kernel_module = _kernel_module()
    try:
        import cutlass.cute as cute

        kernel = kernel_module.BlockScaledGroupedGemm(k_tiles, cfg.tile_n, cfg.raster_along_m, cfg.swizzle,
                                                      cfg.cluster_n, act_inter, trace, glu)
        return cute.compile(kernel.from_pointers, *args, n, n_out, max_active_clusters, stream)
    except Exception as exc:  # noqa: BLE001 - the DSL's own errors (DSLBaseError), ptxas, API drift
        raise _record_build_failure(exc) from exc


#: activations the fused gate_up epilogue implements (others take GEMM 1 + ``act_quant_plan_rows``)
FUSED_ACTIVATIONS = ("silu", "swish")
#: TMA operands (A, B, D) need 16-byte aligned bases; scales and the block map are read element-wise
TMA_ALIGN = 16


@functools.cache
def _element_types() -> dict:
    """The CuTe element type of each torch dtype the kernel reads or writes."""
    import cutlass

    return {torch.float8_e4m3fn: cutlass.Float8E4M3FN, torch.float32: cutlass.Float32, torch.int32: cutlass.Int32,
            torch.int64: cutlass.Int64, torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}


def _pointer(t: torch.Tensor, align: int | None = None):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_ptr

    return make_ptr(_element_types()[t.dtype], t.data_ptr(), cute.AddressSpace.gmem,
                    assumed_align=align or t.element_size())


_COMPILED: dict[tuple, object] = {}


def gemm_arguments(a, sa, w, ws, d, d_scales, block_expert, trace: torch.Tensor | None = None) -> tuple:
    """The kernel's run-time operands in ``BlockScaledGroupedGemm.from_pointers`` order: device pointers of A
    ``[rows, K]``, s_a ``[K/128, rows]``, B ``[E, N, K]``, s_b ``[E, N/128, K/128]``, D ``[rows, N_out]``, D's
    row scales ``[N_out/128, rows]`` (the fused gate_up's output; the plain GEMM passes s_a, unread), the
    block map ``[rows/128]`` and the trace build's counters (``trace_buffer``; others pass the block map, unread);
    the row and expert counts; the strides past each operand's unit one. Only pointers and integers: the views
    are built inside the compiled host function (its docstring says why)."""
    for name, t, unit in (("a", a, 1), ("sa", sa, 1), ("w", w, 2), ("ws", ws, 2), ("d", d, 1),
                          ("d_scales", d_scales, 1), ("block_expert", block_expert, 0)):
        if t.stride(unit) != 1:
            raise ValueError(f"CuTe FP8 GEMM needs {name} contiguous along dim {unit}, got strides {t.stride()}")
    return (_pointer(a, TMA_ALIGN), _pointer(sa), _pointer(w, TMA_ALIGN), _pointer(ws), _pointer(d, TMA_ALIGN),
            _pointer(d_scales), _pointer(block_expert), _pointer(block_expert if trace is None else trace),
            a.shape[0], w.shape[0],
            a.stride(0), sa.stride(0), w.stride(1), w.stride(0), ws.stride(1), ws.stride(0), d.stride(0),
            d_scales.stride(0))


def _launch(a, sa, w, ws, d, d_scales, block_expert, cfg: CuteGemmConfig, act_inter: int,
            trace: torch.Tensor | None = None, glu: ClampedGlu | None = None) -> None:
    import cuda.bindings.driver as cuda

    if trace is not None:
        _check_trace_buffer(trace, a.device)
    k, n, n_out = a.shape[1], w.shape[1], d.shape[1]
    args = gemm_arguments(a, sa, w, ws, d, d_scales, block_expert, trace)
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    key = (d.dtype, cfg, k // FP8_SCALE_BLOCK, n, n_out, act_inter, trace is not None, glu,
           a.device.index)
    compiled = _COMPILED.get(key)
    if compiled is None:
        sms = torch.cuda.get_device_properties(a.device).multi_processor_count
        compiled = _COMPILED[key] = compile_gemm(k // FP8_SCALE_BLOCK, cfg, act_inter, args, n, n_out,
                                                 sms // cfg.cluster_n, stream, trace is not None, glu)
    compiled(*args, stream)


def _check_trace_buffer(trace: torch.Tensor, device) -> None:
    """Every traced launch (not only the one that compiles): the kernel writes a row per CTA, up to one per SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if trace.shape != (sms, TRACE_ROLES, len(TRACE_FIELDS)) or trace.dtype != torch.int64 or not trace.is_contiguous():
        raise ValueError(f"the trace counters are a contiguous [{sms}, {TRACE_ROLES}, {len(TRACE_FIELDS)}] int64 "
                         f"tensor here (fp8_cute_trace.trace_buffer), got {tuple(trace.shape)} {trace.dtype}")


def _check_operands(a, w, n_out: int, cfg: CuteGemmConfig) -> CuteGemmConfig:
    rows, k = a.shape
    if w.shape[2] != k or rows % TILE_M or k % FP8_SCALE_BLOCK or n_out % FP8_SCALE_BLOCK:
        raise ValueError(f"CuTe FP8 GEMM needs K, N multiples of {FP8_SCALE_BLOCK} and rows of {TILE_M}: a {tuple(a.shape)}, "
                         f"w {tuple(w.shape)}")
    if w.stride(2) != 1 or a.stride(1) != 1:
        raise ValueError("CuTe FP8 GEMM needs K-contiguous operands")
    if n_out % cfg.tile_n:
        cfg = dataclasses.replace(cfg, tile_n=FP8_SCALE_BLOCK)  # a wide tile needs N a multiple of its width
    if (n_out // cfg.tile_n) % cfg.cluster_n:
        cfg = dataclasses.replace(cfg, cluster_n=1)  # an odd number of column tiles cannot pair up
    return cfg


def _check_out(out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} {dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    return out


def block_scaled_grouped_gemm(a: torch.Tensor, sa: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                              block_expert: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                              cfg: CuteGemmConfig = PLAIN_CONFIG, trace: torch.Tensor | None = None,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """``d [rows, N]`` = the block-scaled product of plan rows ``a [rows, K]`` (scales ``sa [K/128, rows]``) with
    expert ``block_expert[r // 128]``'s ``w [E, N, K]`` (scales ``ws [E, N/128, K/128]``); idle blocks unwritten.
    ``trace`` (``trace_buffer``): run the trace build, which fills it (``phase_shares`` reads it). ``out``: the
    ``[rows, N]`` tensor to write (launches over chunks of experts fill one output: ``w4a8_moe``)."""
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"CuTe FP8 GEMM writes bf16 or fp16 (a 16-bit stmatrix epilogue), not {out_dtype}")
    cfg = _check_operands(a, w, w.shape[1], cfg)
    shape = (a.shape[0], w.shape[1])
    d = torch.empty(shape, dtype=out_dtype, device=a.device) if out is None else _check_out(out, shape, out_dtype)
    _launch(a, sa, w, ws, d, sa, block_expert, cfg, 0, trace)
    return d


def gate_up_act_quant(a: torch.Tensor, sa: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor,
                      block_expert: torch.Tensor, inter: int, cfg: CuteGemmConfig = FUSED_CONFIG,
                      trace: torch.Tensor | None = None,
                      out: tuple[torch.Tensor, torch.Tensor] | None = None,
                      glu: ClampedGlu | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM 1 fused with SiLU·mul and the e4m3 requantisation: ``(h [rows, I] e4m3, hs [I/128, rows] fp32)``
    from plan rows ``a`` and gate_up ``w1 [E, 2I, H]`` — what ``act_quant_plan_rows`` makes of the unfused
    GEMM's output, without the ``[rows, 2I]`` intermediate (and its bf16 rounding). ``glu``: the clamped SwiGLU
    (``gates.ClampedGlu``, DeepSeek-V4's) instead of SiLU·mul. ``trace``, ``out`` (the ``(h, hs)`` to write): as
    ``block_scaled_grouped_gemm``'s."""
    if w1.shape[1] != 2 * inter:
        raise ValueError(f"gate_up weights {tuple(w1.shape)} are not [E, 2·{inter}, H]")
    cfg = _check_operands(a, w1, inter, dataclasses.replace(cfg, tile_n=TILE_N_FUSED))
    rows = a.shape[0]
    if out is None:
        h = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=a.device)
        hs = torch.empty(inter // FP8_SCALE_BLOCK, rows, dtype=torch.float32, device=a.device)
    else:
        h = _check_out(out[0], (rows, inter), torch.float8_e4m3fn)
        hs = _check_out(out[1], (inter // FP8_SCALE_BLOCK, rows), torch.float32)
    _launch(a, sa, w1, s1, h, hs, block_expert, cfg, inter, trace, glu)
    return h, hs


def plan_rows_moe_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, gemm1, gemm2, *,
                          has_gate: bool = True, activation: str = "silu", fused_gemm1=None) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` through plan-row GEMMs: ``gemm(a, sa, w, ws, block_expert)`` →
    ``[rows, N]`` bf16 is the block-scaled grouped GEMM's contract (``block_scaled_grouped_gemm`` on the GPU;
    the CPU tests pass the torch block math); ``gemm1`` runs gate_up, ``gemm2`` down; the passes around them
    are ``fp8_plan_rows``'s. ``fused_gemm1(a, sa, w1, s1, block_expert, inter)`` → ``(h, hs)``, where given,
    replaces gemm1 + act·quant for SiLU-gated experts."""
    out_dtype = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    inter = w2.shape[2]
    xq, xs = quantize_groups(hidden_states)
    plan = align_routing(topk_ids, w1.shape[0], TILE_M)
    a, sa = gather_plan_rows(xq, xs, plan)
    if fused_gemm1 is not None and has_gate and activation in FUSED_ACTIVATIONS:
        h, hs = fused_gemm1(a, sa, w1, s1, plan.block_expert, inter)
    else:
        gate_up = gemm1(a, sa, w1, s1, plan.block_expert)
        h, hs = act_quant_plan_rows(gate_up, plan, inter, has_gate=has_gate, activation=activation)
    y = gemm2(h, hs, w2, s2, plan.block_expert)
    out = reduce_plan_rows(y, plan, topk_weights, out_dtype=out_dtype)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def cute_fp8_moe_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, *,
                         has_gate: bool = True, activation: str = "silu",
                         cfg1: CuteGemmConfig | None = None, cfg2: CuteGemmConfig = PLAIN_CONFIG,
                         fuse_act: bool = True) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` on the CuTe GEMMs (module docstring); ``cfg1`` (GEMM 1) defaults to
    ``FUSED_CONFIG`` where GEMM 1 is fused, else ``PLAIN_CONFIG``."""
    gemm1 = functools.partial(block_scaled_grouped_gemm, out_dtype=torch.bfloat16, cfg=cfg1 or PLAIN_CONFIG)
    gemm2 = functools.partial(block_scaled_grouped_gemm, out_dtype=torch.bfloat16, cfg=cfg2)
    fused = functools.partial(gate_up_act_quant, cfg=cfg1 or FUSED_CONFIG) if fuse_act else None
    return plan_rows_moe_forward(hidden_states, topk_ids, topk_weights, w1, s1, w2, s2, gemm1, gemm2,
                                 has_gate=has_gate, activation=activation, fused_gemm1=fused)
