"""Plan-row passes of the CuTe FP8 MoE path (``fp8_cute``): the Triton kernels around its two TMA GEMMs.

TMA loads whole row blocks, so the CuTe GEMMs read A in the routing plan's row order (``routing``: each
expert's rows padded to 128) instead of gathering token rows in their A-load as the Triton GEMMs do (a GEMM 1
whose producer warpgroup gathers the rows by ``cp.async`` gave the same bits but ran slower than this pass plus
the TMA GEMM on H200: docs/MODELS.md, branch ``fp8-cute-gather-cpasync``; so did a token-major pass that quantized
each token once and stored it to its k rows by ``plan.row_of_pair`` — scattered row stores, 0.136 against
0.128 ms for quantize + this gather at Qwen3-30B 16K, 0.448 against 0.435 ms at DeepSeek-V3, the same bits:
docs/gpu-runs/2026-12-02-h200-fp8-quantize-scatter-ab.log):

  * ``gather_plan_rows(xq, xs, plan)`` → ``a [rows, H]`` e4m3 and ``sa [⌈H/128⌉, rows]`` fp32: plan row r holds
    token ``pair(r) // k``'s quantized activations and scales; padding rows hold zeros (finite, and scale 0, so
    they add nothing). The scales are stored M-major, the layout the GEMM's per-row scale loads coalesce in;
  * ``act_quant_plan_rows(gate_up, plan, inter)`` → ``h [rows, I]`` e4m3 and ``hs [⌈I/128⌉, rows]``:
    ``act(gate) · up`` in fp32 from GEMM 1's output, quantized per row and 128-column group with the rule of
    ``fp8_quant`` (amax / 448, RNE, saturating) — GEMM 2's A;
  * ``reduce_plan_rows(y, plan, topk_weights)`` → ``[T, H]``: ``Σ_j w[t, j] · y[row(t, j)]`` in fp32 in the fixed
    order j = 0 … k-1 (batch invariant; a pair the plan dropped — expert id outside ``[0, E)`` — counts as 0).
    ``row(p)`` is ``plan.row_of_pair``, the inverse of ``plan.sorted_pairs`` (written by the routing's scatter).

Rows at or past ``plan.num_padded`` are idle (no GEMM tile reads or writes them): every kernel skips them,
and no host synchronisation is needed (grids are sized by the plan's host-side bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ACTIVATIONS, interpreting
from ..quant.scheme import FP8_SCALE_BLOCK
from .fp8_quant import group_scale, scaled, to_e4m3
from .grouped_gemm import _act
from .reduce import reduce_weighted_rows
from .routing import RoutingPlan

#: plan rows per program of the row passes (64 rows × 128 columns: 8 KiB of e4m3, 32 KiB of fp32 per tile)
BLOCK_ROWS = 64
#: activation groups (128 columns each) per program of the gather, and its warps: on H200 (2026-12-02, 16K tokens)
#: two groups and 8 warps moved the Qwen3-30B gather from 0.112 to 0.098 ms and DeepSeek-V3's from 0.392 to
#: 0.339 ms (1, 4 or 8 groups, 32-128 rows, 4 or 8 warps measured; 4+ groups were slower)
GATHER_GROUPS = 2
GATHER_WARPS = 8


@triton.jit
def _gather_kernel(xq_ptr, xs_ptr, sorted_ptr, num_padded_ptr, a_ptr, sa_ptr, num_pairs, top_k, K, num_groups,
                   stride_x, stride_xs, stride_a, stride_sa, BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr,
                   GROUPS: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_ROWS
    if r0 >= tl.load(num_padded_ptr):
        return
    g0 = tl.program_id(1) * GROUPS
    rows = r0 + tl.arange(0, BLOCK_ROWS)
    pairs = tl.load(sorted_ptr + rows)
    live = pairs < num_pairs
    tokens = tl.where(live, pairs // top_k, 0).to(tl.int64)
    cols = g0 * GROUP + tl.arange(0, GROUPS * GROUP)
    ok = live[:, None] & (cols[None, :] < K)
    x = tl.load(xq_ptr + tokens[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    tl.store(a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :], x, mask=cols[None, :] < K)
    groups = g0 + tl.arange(0, GROUPS)
    in_k = groups[None, :] < num_groups
    s = tl.load(xs_ptr + tokens[:, None] * stride_xs + groups[None, :], mask=live[:, None] & in_k, other=0.0)
    tl.store(sa_ptr + groups[None, :] * stride_sa + rows[:, None], s, mask=in_k)


@triton.jit
def _act_quant_kernel(gu_ptr, h_ptr, hs_ptr, num_padded_ptr, inter, stride_gu, stride_h, stride_hs,
                      HAS_GATE: tl.constexpr, ACT: tl.constexpr, BLOCK_ROWS: tl.constexpr, GROUP: tl.constexpr,
                      EMULATE: tl.constexpr):
    r0 = tl.program_id(0) * BLOCK_ROWS
    if r0 >= tl.load(num_padded_ptr):
        return
    g = tl.program_id(1)
    rows = (r0 + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = cols[None, :] < inter
    base = gu_ptr + rows[:, None] * stride_gu + cols[None, :]
    act = _act(tl.load(base, mask=ok, other=0.0).to(tl.float32), ACT)
    if HAS_GATE:
        act = act * tl.load(base + inter, mask=ok, other=0.0).to(tl.float32)
    s = group_scale(tl.max(tl.abs(act), axis=1))
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], to_e4m3(scaled(act, s[:, None]), EMULATE), mask=ok)
    tl.store(hs_ptr + g * stride_hs + rows, s)


def gather_plan_rows(xq: torch.Tensor, xs: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a [rows, K] e4m3, sa [⌈K/128⌉, rows] fp32)`` in plan-row order (module docstring)."""
    rows, k = plan.sorted_pairs.numel(), xq.shape[1]
    groups = triton.cdiv(k, FP8_SCALE_BLOCK)
    a = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=xq.device)
    sa = torch.empty(groups, rows, dtype=torch.float32, device=xq.device)
    _gather_kernel[(triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(groups, GATHER_GROUPS))](
        xq, xs, plan.sorted_pairs, plan.num_padded, a, sa, plan.num_pairs, plan.top_k, k, groups,
        xq.stride(0), xs.stride(0), a.stride(0), sa.stride(0), BLOCK_ROWS=BLOCK_ROWS, GROUP=FP8_SCALE_BLOCK,
        GROUPS=GATHER_GROUPS, num_warps=GATHER_WARPS)
    return a, sa


def act_quant_plan_rows(gate_up: torch.Tensor, plan: RoutingPlan, inter: int, *, has_gate: bool = True,
                        activation: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """``(h [rows, I] e4m3, hs [⌈I/128⌉, rows] fp32)`` from GEMM 1's ``[rows, 2I]`` (``[rows, I]`` without a gate)."""
    rows = gate_up.shape[0]
    groups = triton.cdiv(inter, FP8_SCALE_BLOCK)
    h = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    hs = torch.empty(groups, rows, dtype=torch.float32, device=gate_up.device)
    _act_quant_kernel[(triton.cdiv(rows, BLOCK_ROWS), groups)](
        gate_up, h, hs, plan.num_padded, inter, gate_up.stride(0), h.stride(0), hs.stride(0),
        HAS_GATE=has_gate, ACT=ACTIVATIONS[activation], BLOCK_ROWS=BLOCK_ROWS, GROUP=FP8_SCALE_BLOCK, EMULATE=interpreting())
    return h, hs


def reduce_plan_rows(y: torch.Tensor, plan: RoutingPlan, topk_weights: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """``[T, H]`` = fixed-order fp32 ``Σ_j w[t, j] · y[row(t, j)]`` (module docstring; ``reduce``'s program)."""
    return reduce_weighted_rows(y, plan.row_of_pair, topk_weights, out_dtype=out_dtype)
