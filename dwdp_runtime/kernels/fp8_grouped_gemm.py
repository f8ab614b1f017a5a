"""The two grouped GEMMs of an MoE block with FP8 e4m3 weights in 128×128 blocks and FP8 activations in 1×128
groups (DeepSeek-V3's fine-grained scheme), bf16 out, reading the weights and their scales through the
strided ``[E, N, K]`` / ``[E, ⌈N/128⌉, ⌈K/128⌉]`` composite views as the runtime binds them (no copy).

Same structure as the bf16 kernels (``grouped_gemm``: routing-plan row blocks of one expert, GROUP_M swizzle,
idle blocks exit, int64 weight offsets) — their ``_tile_ids`` / ``_block_rows`` / ``_act`` are reused — with:

  * BLOCK_K = 128 = the scale block: each K step is one ``tl.dot`` of e4m3 tiles (fp32 result) scaled by the
    rows' activation scales and the columns' weight scale before it joins the fp32 accumulator:
    ``acc += dot(a_q, w_q) · (s_a · s_w)[:, None]`` — the exact block-scaled product. A tile of 128 (or 64)
    columns lies in one 128-row scale block, so ``s_w`` is one scalar per K step and the promotion is one FMA
    per accumulator element (GEMM 2 with 256-column tiles loads one scale per column instead);
  * the promotion needs the MMA's result, so every K step waits for its ``wgmma``: a program's MMAs and
    promotions serialise (Triton issues the zero-initialised dot and waits at once), and the SM stays busy
    only by holding several programs — the tiles are chosen by registers per program (``fp8_moe``);
  * weight scale of output column n: row ``n // 128`` of the scale grid, plus ``up_srow`` (= ⌈I/128⌉, the
    gate's scale rows) for the up half of ``gate_up`` — gate and up are quantized separately in the
    checkpoints, so their blocks never straddle the halves;
  * ``fp8_gate_up_kernel`` (GEMM 1): one program = one row block × one 128-column activation group. The
    A-load gathers ``x_q[token(r)]`` (the ``[T, H]`` activations quantized once per token and 128-column group
    by ``fp8_quant``) and its scales — no ``[T·k, H]`` copy; the group is computed in one pass (``SUB_N`` =
    128) or two 64-column passes (the first pass's activations wait in registers: half the accumulators).
    Epilogue: act·mul in fp32, then the ``[BLOCK_M, 128]`` group **quantized per row** to e4m3 + one fp32
    scale per row: GEMM 2 reads 1 byte per activation, and no ``[T·k, 2I]`` or bf16 ``[T·k, I]``
    intermediate reaches HBM;
  * ``fp8_down_kernel`` (GEMM 2): A = those e4m3 rows + scales; epilogue × routing weight, stored to row
    ``pair`` of ``y [T·k, H]`` for the fixed-order top-k reduction (``reduce``);
  * weight tiles through pointers or, with ``GemmConfig.tma`` and a view TMA can describe, through host-side
    TMA descriptors of the same ``[E, N, K]`` view (``grouped_gemm._b_tile``): same operands, same bits.

Batch invariance as the bf16 kernels: one row against one column, fp32 over K in ascending 128-steps, no
split-K, no atomics; BLOCK_K is fixed at 128, and the row block at 64 (``fp8_moe.ROW_BLOCK``: a 16/32-row block
compiles to mma.sync, whose sums within a K step round otherwise on the GPU — measured, 2026-12-07), so a row's
bits do not depend on the batch (tested; the interpreter's every tiling agrees). Under Triton's interpreter the e4m3 operands are widened to
fp32 before the dot (its fp8 dot is wrong; the products of e4m3 values are exact in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.scheme import FP8_SCALE_BLOCK
from . import ACTIVATIONS, interpreting
from ._cast import cast_out
from .fp8_quant import group_scale, scaled, to_e4m3
from .grouped_gemm import _act, _b_tile, _block_rows, _glu, _grid, _tile_ids, _weight_descriptor, glu_constexprs
from .routing import RoutingPlan

#: GEMM 1 sub-tile widths: the whole 128-column group in one pass, or two 64-column passes (half the fp32
#: accumulator registers: at 64 rows and 4 warps one pass spills, two do not — the program then fits 3 per SM)
GATE_UP_SUB_N = (64, 128)


@triton.jit
def _dot8(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _w_scale(s_row_ptrs, s_tile_ptr, kb, stride_sk, SCALAR_WS: tl.constexpr):
    """The weight scales of one K step: one scalar when the tile's columns lie in one 128-row scale block
    (``SCALAR_WS``: BLOCK_N divides 128, tiles aligned to it), else one per column. The scalar form turns the
    promotion into one FMA per accumulator element (``acc += dot · (s_a·s_w)[:, None]``) instead of a
    multiply of the ``[BLOCK_M, BLOCK_N]`` scale product first; the values are the same products."""
    if SCALAR_WS:
        s = tl.load(s_tile_ptr + kb * stride_sk)
    else:
        s = tl.load(s_row_ptrs + kb * stride_sk)
    return s


@triton.jit
def _promote(acc, part, a_s, w_s, SCALAR_WS: tl.constexpr):
    """``acc + part · s_a[:, None] · s_w`` — one K block's fp32 dot scaled and added (the exact block product)."""
    if SCALAR_WS:
        acc = acc + part * (a_s * w_s)[:, None]
    else:
        acc = acc + part * (a_s[:, None] * w_s[None, :])
    return acc


@triton.jit
def _gate_up_cols(a_ptrs, as_ptrs, live, w_base, w_desc, e32, s_base, b_base, c0, N, K, up_offset, up_srow,
                  stride_wn, stride_wk, stride_sn, stride_sk, stride_bg, bias_up,
                  HAS_GATE: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
                  BLOCK_M: tl.constexpr, SUB_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                  HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
                  UP_SHIFT: tl.constexpr):
    """``act(x·Wg + bg)·(x·Wu + bu)`` (or the clamped SwiGLU, ``grouped_gemm._glu``) of the block's rows and columns
    ``[c0, c0 + SUB_N)``, fp32, zero past N. The gate bias of column c is ``b_base[c · stride_bg]``, the up bias
    ``bias_up`` elements after it (``[gate; up]`` halves or gpt-oss's interleaved rows: the host's strides).

    The columns lie in one 128-row weight-scale block (``c0 // 128``): one scalar weight scale per K step."""
    offs_n = c0 + tl.arange(0, SUB_N)
    cols = offs_n % N  # wrap a ragged tail onto valid columns; zeroed below, masked at the store
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_base + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn
    gs_tile = s_base + (c0 // BLOCK_K) * stride_sn
    us_tile = s_base + (up_srow + c0 // BLOCK_K) * stride_sn
    acc_g = tl.zeros([BLOCK_M, SUB_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, SUB_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=live[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=live[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=live, other=0.0)
        g = _b_tile(g_ptrs + kb * BLOCK_K * stride_wk, w_desc, e32, c0, kb * BLOCK_K, k_ok, EVEN_K, USE_TMA,
                    SUB_N, BLOCK_K)
        acc_g = _promote(acc_g, _dot8(a, g, UPCAST), a_s, tl.load(gs_tile + kb * stride_sk), True)
        if HAS_GATE:
            u = _b_tile(u_ptrs + kb * BLOCK_K * stride_wk, w_desc, e32, c0 + up_offset, kb * BLOCK_K, k_ok, EVEN_K,
                        USE_TMA, SUB_N, BLOCK_K)
            acc_u = _promote(acc_u, _dot8(a, u, UPCAST), a_s, tl.load(us_tile + kb * stride_sk), True)
    if HAS_BIAS:
        b_ptrs = b_base + cols * stride_bg
        acc_g += tl.load(b_ptrs).to(tl.float32)[None, :]
        if HAS_GATE:
            acc_u += tl.load(b_ptrs + bias_up).to(tl.float32)[None, :]
    if HAS_GATE:
        act = _glu(acc_g, acc_u, ACT, CLAMP, LIMIT, ALPHA, UP_SHIFT)
    else:
        act = _act(acc_g, ACT)
    return tl.where((offs_n < N)[None, :], act, 0.0)


@triton.jit
def _store_e4m3(out_ptr, r64, stride_om, c0, act, s, N, SUB_N: tl.constexpr, UPCAST: tl.constexpr):
    offs_n = c0 + tl.arange(0, SUB_N)
    tl.store(out_ptr + r64[:, None] * stride_om + offs_n[None, :], to_e4m3(scaled(act, s[:, None]), UPCAST),
             mask=(offs_n < N)[None, :])


@triton.jit
def fp8_gate_up_kernel(
    xq_ptr, xs_ptr, w_ptr, w_desc, ws_ptr, bias_ptr, out_ptr, outs_ptr, sorted_ptr, block_expert_ptr,
    num_padded_ptr, num_pairs, max_blocks, N, K, top_k, up_offset, up_srow, bias_up,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_bg,
    stride_om, stride_osm,
    HAS_GATE: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, SUB_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    UP_SHIFT: tl.constexpr,
):
    # one program = BLOCK_M rows × one 128-column activation group (BLOCK_K = 128 wide), computed in
    # 128 // SUB_N passes over K (SUB_N = 64: two passes, half the accumulator registers; the first pass's
    # activations wait in registers for the group's amax)
    pid_m, pid_n, idle = _tile_ids(max_blocks, N, num_padded_ptr, BLOCK_M, BLOCK_K, GROUP_M)
    if idle:
        return
    expert, rows, pairs, live = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    if expert < 0:   # a block of another chunk of experts (W4A8's chunked re-encoding): not this launch's
        return
    tokens = tl.where(live, pairs // top_k, 0).to(tl.int64)
    n0 = pid_n * BLOCK_K
    a_ptrs = xq_ptr + tokens[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    as_ptrs = xs_ptr + tokens * stride_xsm
    w_base = w_ptr + expert * stride_we
    s_base = ws_ptr + expert * stride_se
    b_base = bias_ptr + expert * stride_be
    e32 = expert.to(tl.int32)
    r64 = rows.to(tl.int64)
    act0 = _gate_up_cols(a_ptrs, as_ptrs, live, w_base, w_desc, e32, s_base, b_base, n0, N, K, up_offset, up_srow,
                         stride_wn, stride_wk, stride_sn, stride_sk, stride_bg, bias_up, HAS_GATE, ACT, EVEN_K,
                         USE_TMA, BLOCK_M, SUB_N, BLOCK_K, UPCAST, HAS_BIAS, CLAMP, LIMIT, ALPHA, UP_SHIFT)
    if SUB_N == BLOCK_K:
        s = group_scale(tl.max(tl.abs(act0), axis=1))
        _store_e4m3(out_ptr, r64, stride_om, n0, act0, s, N, SUB_N, UPCAST)
    else:
        act1 = _gate_up_cols(a_ptrs, as_ptrs, live, w_base, w_desc, e32, s_base, b_base, n0 + SUB_N, N, K,
                             up_offset, up_srow, stride_wn, stride_wk, stride_sn, stride_sk, stride_bg, bias_up,
                             HAS_GATE, ACT, EVEN_K, USE_TMA, BLOCK_M, SUB_N, BLOCK_K, UPCAST, HAS_BIAS, CLAMP, LIMIT,
                             ALPHA, UP_SHIFT)
        s = group_scale(tl.maximum(tl.max(tl.abs(act0), axis=1), tl.max(tl.abs(act1), axis=1)))
        _store_e4m3(out_ptr, r64, stride_om, n0, act0, s, N, SUB_N, UPCAST)
        _store_e4m3(out_ptr, r64, stride_om, n0 + SUB_N, act1, s, N, SUB_N, UPCAST)
    tl.store(outs_ptr + r64 * stride_osm + pid_n, s)


@triton.jit
def fp8_down_kernel(
    aq_ptr, as_ptr, w_ptr, w_desc, ws_ptr, bias_ptr, weight_ptr, y_ptr, sorted_ptr, block_expert_ptr,
    num_padded_ptr, num_pairs, max_blocks, N, K,
    stride_am, stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be, stride_bn,
    stride_ym,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, SCALAR_WS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    pid_m, pid_n, idle = _tile_ids(max_blocks, N, num_padded_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if idle:
        return
    expert, rows, pairs, live = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    if expert < 0:   # another chunk's block (as GEMM 1)
        return
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)
    # padding rows of the activation are finite (GEMM 1 quantized zeros to zeros, scale 1): no row mask
    a_ptrs = aq_ptr + r64[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + r64 * stride_asm
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    ws_ptrs = ws_ptr + expert * stride_se + (cols // BLOCK_K) * stride_sn
    ws_tile = ws_ptr + expert * stride_se + (n0 // BLOCK_K) * stride_sn
    e32 = expert.to(tl.int32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb)
        w = _b_tile(w_ptrs, w_desc, e32, n0, kb * BLOCK_K, k_ok, EVEN_K, USE_TMA, BLOCK_N, BLOCK_K)
        acc = _promote(acc, _dot8(a, w, UPCAST), a_s, _w_scale(ws_ptrs, ws_tile, kb, stride_sk, SCALAR_WS),
                       SCALAR_WS)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:   # the expert's output bias, before the routing weight (as `transformers`' experts add it)
        acc += tl.load(bias_ptr + expert * stride_be + cols * stride_bn).to(tl.float32)[None, :]
    route_w = tl.load(weight_ptr + pairs, mask=live, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    y_ptrs = y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, cast_out(acc, y_ptr.dtype.element_ty, UPCAST), mask=live[:, None] & (offs_n[None, :] < N))


#: interpreter-only paths: e4m3 operands widened before the dot, e4m3/bf16 rounding done on the bits
_UPCAST = interpreting()


def fp8_gate_up(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, plan: RoutingPlan, cfg, *,
                inter: int, up_srow: int, has_gate: bool = True, activation: str = "silu",
                bias: torch.Tensor | None = None, bias_interleaved: bool = False, glu=None,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM 1: ``(act_q [max_rows, I] e4m3, act_s [max_rows, ⌈I/128⌉] fp32)`` in plan-row order.

    ``w [E, 2I, H]`` (``[E, I, H]`` without a gate) e4m3, ``ws`` its scale grid; ``up_srow`` = the scale row
    where the up half starts (⌈I/128⌉). Any strides. ``cfg.block_n`` is the sub-tile width: every program
    produces one 128-column activation group, in one pass (128) or two (64). ``bias [E, 2I]`` (``[E, I]``
    without a gate) is added before the activation, its rows ``[gate; up]`` or, ``bias_interleaved``, gpt-oss's
    gate/up pairs; ``glu`` a ``gates.ClampedGlu`` epilogue. ``out``: the pair to write (blocks whose expert is
    -1 are skipped and leave it untouched: a chunk of experts per launch)."""
    if cfg.block_n not in GATE_UP_SUB_N or cfg.block_k != FP8_SCALE_BLOCK:
        raise ValueError(f"fp8 gate_up needs BLOCK_K = {FP8_SCALE_BLOCK} and BLOCK_N in {GATE_UP_SUB_N} (sub-tiles of one "
                         f"{FP8_SCALE_BLOCK}-column activation group), got {cfg.block_n}×{cfg.block_k}")
    hidden = xq.shape[1]
    rows = plan.sorted_pairs.numel()
    if out is None:
        out = (torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=xq.device),
               torch.empty(rows, triton.cdiv(inter, FP8_SCALE_BLOCK), dtype=torch.float32, device=xq.device))
    act_q, act_s = out
    stride_be, stride_bg, bias_up = _gate_up_bias_strides(bias, inter, has_gate, bias_interleaved)
    desc = _weight_descriptor(w, w.shape[1], hidden, tuple(w.stride()), cfg)
    fp8_gate_up_kernel[(plan.max_blocks * triton.cdiv(inter, FP8_SCALE_BLOCK),)](
        xq, xs, w, desc, ws, ws if bias is None else bias, act_q, act_s, plan.sorted_pairs, plan.block_expert,
        plan.num_padded, plan.num_pairs, plan.max_blocks, inter, hidden, plan.top_k, inter, up_srow, bias_up,
        xq.stride(0), xs.stride(0), *w.stride(), *ws.stride(), stride_be, stride_bg, act_q.stride(0),
        act_s.stride(0),
        HAS_GATE=has_gate, ACT=ACTIVATIONS[activation], EVEN_K=hidden % FP8_SCALE_BLOCK == 0,
        USE_TMA=desc is not None, BLOCK_M=plan.block_m, SUB_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=_UPCAST, HAS_BIAS=bias is not None, **glu_constexprs(glu),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return act_q, act_s


def _gate_up_bias_strides(bias: torch.Tensor | None, inter: int, has_gate: bool, interleaved: bool
                          ) -> tuple[int, int, int]:
    """(expert stride, gate column stride, up offset) of GEMM 1's bias in elements (zeros without one)."""
    if bias is None:
        return 0, 0, 0
    want = (2 if has_gate else 1) * inter
    if bias.dim() != 2 or bias.shape[1] != want:
        raise ValueError(f"gate_up bias {tuple(bias.shape)}: want [E, {want}]")
    col = bias.stride(1)
    if not has_gate:
        return bias.stride(0), col, 0
    return (bias.stride(0), 2 * col, col) if interleaved else (bias.stride(0), col, inter * col)


def fp8_down(aq: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, weights: torch.Tensor,
             plan: RoutingPlan, cfg, *, hidden: int, out_dtype=torch.bfloat16, bias: torch.Tensor | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM 2: ``y [T·k, hidden]`` = routing weight × (act · Wd[e] + bias[e]) in (token, k) row order;
    ``w [E, H, I]`` e4m3, ``bias [E, H]``. ``out``: the ``y`` to write (blocks of expert -1 skipped, as GEMM 1)."""
    if cfg.block_k != FP8_SCALE_BLOCK:
        raise ValueError(f"fp8 down needs BLOCK_K = {FP8_SCALE_BLOCK}")
    if bias is not None and (bias.dim() != 2 or bias.shape[1] != hidden):
        raise ValueError(f"down bias {tuple(bias.shape)}: want [E, {hidden}]")
    inter = aq.shape[1]
    y = torch.empty(plan.num_pairs, hidden, dtype=out_dtype, device=aq.device) if out is None else out
    desc = _weight_descriptor(w, hidden, inter, tuple(w.stride()), cfg)
    fp8_down_kernel[_grid(plan, hidden, cfg)](
        aq, a_s, w, desc, ws, ws if bias is None else bias, weights.reshape(-1), y, plan.sorted_pairs,
        plan.block_expert, plan.num_padded, plan.num_pairs, plan.max_blocks, hidden, inter,
        aq.stride(0), a_s.stride(0), *w.stride(), *ws.stride(), *((0, 0) if bias is None else bias.stride()),
        y.stride(0),
        EVEN_K=inter % FP8_SCALE_BLOCK == 0, USE_TMA=desc is not None, SCALAR_WS=FP8_SCALE_BLOCK % cfg.block_n == 0,
        BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=_UPCAST,
        HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
