"""The two grouped GEMMs of an MoE block with FP8 e4m3 weights in 128×128 blocks and FP8 activations in 1×128
groups (DeepSeek-V3's fine-grained scheme), bf16 out, reading the weights and their scales through the
strided ``[E, N, K]`` / ``[E, ⌈N/128⌉, ⌈K/128⌉]`` composite views as the runtime binds them (no copy).

Same structure as the bf16 kernels (``grouped_gemm``: routing-plan row blocks of one expert, GROUP_M swizzle,
idle blocks exit, int64 weight offsets) — their ``_tile_ids`` / ``_block_rows`` / ``_act`` are reused — with:

  * BLOCK_K = 128 = the scale block: each K step is one ``tl.dot`` of e4m3 tiles (fp32 result) scaled by the
    rows' activation scales and the columns' weight scales before it joins the fp32 accumulator:
    ``acc += dot(a_q, w_q) · s_a[:, None] · s_w[None, :]`` — the exact block-scaled product;
  * weight scale of output column n: row ``n // 128`` of the scale grid, plus ``up_srow`` (= ⌈I/128⌉, the
    gate's scale rows) for the up half of ``gate_up`` — gate and up are quantized separately in the
    checkpoints, so their blocks never straddle the halves;
  * ``fp8_gate_up_kernel`` (GEMM 1): the A-load gathers ``x_q[token(r)]`` (the ``[T, H]`` activations
    quantized once per token and 128-column group by ``fp8_quant``) and its scales — no ``[T·k, H]`` copy;
    epilogue: act·mul in fp32, then the ``[BLOCK_M, 128]`` tile **quantized per row** (BLOCK_N = 128 = one
    activation group) to e4m3 + one fp32 scale per row: GEMM 2 reads 1 byte per activation, and no
    ``[T·k, 2I]`` or bf16 ``[T·k, I]`` intermediate reaches HBM;
  * ``fp8_down_kernel`` (GEMM 2): A = those e4m3 rows + scales; epilogue × routing weight, stored to row
    ``pair`` of ``y [T·k, H]`` for the fixed-order top-k reduction (``reduce``).

Batch invariance as the bf16 kernels: one row against one column, fp32 over K in ascending 128-steps, no
split-K, no atomics; BLOCK_K is fixed at 128. Under Triton's interpreter the e4m3 operands are widened to
fp32 before the dot (its fp8 dot is wrong; the products of e4m3 values are exact in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ACTIVATIONS, interpreting
from ._cast import cast_out
from .fp8_quant import group_scale, scaled, to_e4m3
from .grouped_gemm import _act, _block_rows, _grid, _tile_ids
from .routing import RoutingPlan

#: the scale block of the weights and the activation group: 128 (weight_block_size [128, 128])
SCALE_BLOCK = 128


@triton.jit
def _dot8(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def fp8_gate_up_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, outs_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, max_blocks, N, K, top_k, up_offset, up_srow,
    stride_xm, stride_xsm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om, stride_osm,
    HAS_GATE: tl.constexpr, ACT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(max_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, rows, pairs, live = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    tokens = tl.where(live, pairs // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = xq_ptr + tokens[:, None] * stride_xm + offs_k[None, :]
    as_ptrs = xs_ptr + tokens * stride_xsm
    w_base = w_ptr + expert * stride_we
    g_ptrs = w_base + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn
    s_base = ws_ptr + expert * stride_se
    gs_ptrs = s_base + (cols // BLOCK_K) * stride_sn
    us_ptrs = s_base + (up_srow + cols // BLOCK_K) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=live, other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None], other=0.0)
        g_s = tl.load(gs_ptrs + kb * stride_sk)
        acc_g += _dot8(a, g, UPCAST) * (a_s[:, None] * g_s[None, :])
        if HAS_GATE:
            u = tl.load(u_ptrs, mask=k_ok[:, None], other=0.0)
            u_s = tl.load(us_ptrs + kb * stride_sk)
            acc_u += _dot8(a, u, UPCAST) * (a_s[:, None] * u_s[None, :])
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if HAS_GATE:
        act = _act(acc_g, ACT) * acc_u
    else:
        act = _act(acc_g, ACT)
    n_ok = offs_n < N
    act = tl.where(n_ok[None, :], act, 0.0)
    s = group_scale(tl.max(tl.abs(act), axis=1))
    r64 = rows.to(tl.int64)
    tl.store(out_ptr + r64[:, None] * stride_om + offs_n[None, :], to_e4m3(scaled(act, s[:, None]), UPCAST),
             mask=n_ok[None, :])
    tl.store(outs_ptr + r64 * stride_osm + pid_n, s)


@triton.jit
def fp8_down_kernel(
    aq_ptr, as_ptr, w_ptr, ws_ptr, weight_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, max_blocks, N, K,
    stride_am, stride_asm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(max_blocks, N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, rows, pairs, live = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)
    # padding rows of the activation are finite (GEMM 1 quantized zeros to zeros, scale 1): no row mask
    a_ptrs = aq_ptr + r64[:, None] * stride_am + offs_k[None, :]
    as_ptrs = as_ptr + r64 * stride_asm
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    ws_ptrs = ws_ptr + expert * stride_se + (cols // BLOCK_K) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb)
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        w_s = tl.load(ws_ptrs + kb * stride_sk)
        acc += _dot8(a, w, UPCAST) * (a_s[:, None] * w_s[None, :])
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    route_w = tl.load(weight_ptr + pairs, mask=live, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    y_ptrs = y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, cast_out(acc, y_ptr.dtype.element_ty, UPCAST), mask=live[:, None] & (offs_n[None, :] < N))


#: interpreter-only paths: e4m3 operands widened before the dot, e4m3/bf16 rounding done on the bits
_UPCAST = interpreting()


def fp8_gate_up(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, plan: RoutingPlan, cfg, *,
                inter: int, up_srow: int, has_gate: bool = True, activation: str = "silu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM 1: ``(act_q [max_rows, I] e4m3, act_s [max_rows, ⌈I/128⌉] fp32)`` in plan-row order.

    ``w [E, 2I, H]`` (``[E, I, H]`` without a gate) e4m3, ``ws`` its scale grid; ``up_srow`` = the scale row
    where the up half starts (⌈I/128⌉). Any strides."""
    if cfg.block_n != SCALE_BLOCK or cfg.block_k != SCALE_BLOCK:
        raise ValueError(f"fp8 gate_up needs BLOCK_N = BLOCK_K = {SCALE_BLOCK} (one activation group per tile)")
    hidden = xq.shape[1]
    rows = plan.sorted_pairs.numel()
    out = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=xq.device)
    outs = torch.empty(rows, triton.cdiv(inter, SCALE_BLOCK), dtype=torch.float32, device=xq.device)
    fp8_gate_up_kernel[_grid(plan, inter, cfg)](
        xq, xs, w, ws, out, outs, plan.sorted_pairs, plan.block_expert, plan.num_padded,
        plan.num_pairs, plan.max_blocks, inter, hidden, plan.top_k, inter, up_srow,
        xq.stride(0), xs.stride(0), *w.stride(), *ws.stride(), out.stride(0), outs.stride(0),
        HAS_GATE=has_gate, ACT=ACTIVATIONS[activation], BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=_UPCAST, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, outs


def fp8_down(aq: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, weights: torch.Tensor,
             plan: RoutingPlan, cfg, *, hidden: int, out_dtype=torch.bfloat16) -> torch.Tensor:
    """GEMM 2: ``y [T·k, hidden]`` = routing weight × (act · Wd[e]) in (token, k) row order; ``w [E, H, I]`` e4m3."""
    if cfg.block_k != SCALE_BLOCK:
        raise ValueError(f"fp8 down needs BLOCK_K = {SCALE_BLOCK}")
    inter = aq.shape[1]
    y = torch.empty(plan.num_pairs, hidden, dtype=out_dtype, device=aq.device)
    fp8_down_kernel[_grid(plan, hidden, cfg)](
        aq, a_s, w, ws, weights.reshape(-1), y, plan.sorted_pairs, plan.block_expert, plan.num_padded,
        plan.num_pairs, plan.max_blocks, hidden, inter,
        aq.stride(0), a_s.stride(0), *w.stride(), *ws.stride(), y.stride(0),
        BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=_UPCAST,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
