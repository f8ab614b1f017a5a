"""The two grouped GEMMs of an MoE block, reading expert weights through strided ``[E, N, K]`` views.

Both kernels run over the ``RoutingPlan`` rows (pairs grouped by expert, padded to BLOCK_M): program
``pid`` takes one ``BLOCK_M × BLOCK_N`` output tile of one row block; every row of a block belongs to
the same expert (``plan.block_expert``), so the B tile is one expert's weight slice. Programs are
ordered in groups of GROUP_M row blocks sharing each column block (the usual L2 swizzle: a group's A rows
and one expert's B columns stay in L2 while the group sweeps them). Programs of idle blocks (at or past
``plan.num_padded``) exit before loading anything: the grids are sized from shapes, never synchronised.

``gate_up_kernel`` (GEMM 1):  ``act[r, n] = silu(x[tok(r)] · Wg[e, n]) * (x[tok(r)] · Wu[e, n])``
  * gather fused into the A-load: row r of the block reads ``hidden[sorted_pairs[r] // top_k]`` straight
    from the ``[T, H]`` activations — no ``[T·k, H]`` copy; padding rows load zeros;
  * gate and up columns of the same n are two B tiles (``gate col = n·col_step``, ``up col = gate col +
    up_offset``: ``[gate; up]`` halves are ``(1, I)``, interleaved ``g0 u0 g1 u1 …`` are ``(2, 1)``), two fp32
    accumulators, so SiLU·mul runs in the epilogue and only ``[rows, I]`` bf16 reaches HBM — no
    ``[T·k, 2I]`` intermediate; optional bias ``[E, 2I]`` is added before the activation. Without a gate
    (``HAS_GATE=False``) the one accumulator goes through the activation alone;
  * output rows are plan rows (``[max_rows, I]``), so GEMM 2's A-load is contiguous.

``down_kernel`` (GEMM 2):  ``y[p] = w[p] * (act[r] · Wd[e]) (+ bias before the weight)``
  * the routing weight ``w[p]`` (``topk_weights`` flat, any float dtype) multiplies the fp32 accumulator
    in the epilogue; the tile is stored to row ``p`` of ``y [T·k, H]`` — (token, k) order — so the top-k
    reduction reads each token's k rows contiguously; padding rows store nothing.

Weights: any strides (``stride_we, stride_wn, stride_wk``) — the composite tensor as the runtime binds
it, a transposed ``[E, K, N]`` layout (swap the two strides), or a slice; nothing is copied or made
contiguous. Offsets into weights are computed in int64 (E·N·K exceeds 2³¹ at DeepSeek-V3 scale). With
``GemmConfig.tma`` (and a view TMA can describe: K contiguous, consecutive columns, 16-byte aligned) the
weight tiles come through a host-side TMA descriptor of the same ``[E, N, K]`` view (``_b_tile``; 8 %
faster per GEMM on an H200 at 16K tokens) — the same operand values, the same MMA sequence.

Invariants (batch invariance): every output element is one row of A against one column of B, accumulated
in fp32 over K in ascending BLOCK_K steps; no split-K, no atomics. A row's value therefore does not depend
on which other rows share its block, on the row's position in the plan, or on T — only on the config's
BLOCK_K pipeline, which the tuner keeps fixed per weight shape (``tuning``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .support import ACTIVATIONS, interpreting
from ._cast import cast_out
from .routing import RoutingPlan
from .tuning import GemmConfig


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 0:
        return x * tl.sigmoid(x)
    elif ACT == 1:
        # tanh-approximate GELU through sigmoid: 0.5·(1 + tanh(z)) = sigmoid(2z)
        return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    else:
        return tl.maximum(x, 0.0)


@triton.jit
def _glu(acc_g, acc_u, ACT: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
         UP_SHIFT: tl.constexpr):
    """GEMM 1's epilogue with a gate: ``act(g) · u``, or with ``CLAMP`` the clamped SwiGLU of ``gates.ClampedGlu``
    (``g·sigmoid(ALPHA·g) · (u + UP_SHIFT)`` on ``g = min(g, LIMIT)``, ``u = clamp(u, −LIMIT, LIMIT)``)."""
    if CLAMP:
        g = tl.minimum(acc_g, LIMIT)
        u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
        return g * tl.sigmoid(g * ALPHA) * (u + UP_SHIFT)
    return _act(acc_g, ACT) * acc_u


def glu_constexprs(glu) -> dict:
    """The kernels' CLAMP / LIMIT / ALPHA / UP_SHIFT for a ``gates.ClampedGlu`` (or None: the plain gate)."""
    if glu is None:
        return dict(CLAMP=False, LIMIT=0.0, ALPHA=1.0, UP_SHIFT=0.0)
    return dict(CLAMP=True, LIMIT=float(glu.limit), ALPHA=float(glu.alpha), UP_SHIFT=float(glu.up_shift))


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    # Triton's CPU interpreter multiplies bf16 operands as their raw uint16 bits (seen with triton 3.9):
    # under the interpreter only, the operands go through fp32 first (exact for bf16/fp16 values)
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _tile_ids(max_blocks, N, num_padded_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The program's row block and column block (GROUP_M swizzle order), and whether the row block is idle: at or
    past ``num_padded`` (the kernel returns on it before loading anything else)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(max_blocks - first_m, GROUP_M)
    pid_m = first_m + ((pid % per_group) % group_m)
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n, pid_m * BLOCK_M >= tl.load(num_padded_ptr)


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """The block's expert (int64: weight offsets pass 2**31), its plan rows, their pairs, which are live."""
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    return expert, rows, pairs, pairs < num_pairs


@triton.jit
def _block_tile(sorted_ptr, block_expert_ptr, pid_m, pid_n, col_step, num_pairs, N, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A tile's rows and columns: its row block's expert, plan rows, pairs and which are live (``_block_rows``);
    its column block's first output column (the TMA box's N coordinate), its BLOCK_N output columns, and the weight
    columns they read: the ragged tail wrapped onto valid columns (masked at the store), times ``col_step``."""
    expert, rows, pairs, live = _block_rows(sorted_ptr, block_expert_ptr, pid_m, num_pairs, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, pairs, live, pid_n * BLOCK_N, offs_n, (offs_n % N) * col_step


@triton.jit
def _b_tile(ptrs, desc, expert, n0, k0, k_ok, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One [BLOCK_K, BLOCK_N] weight tile: through the copy engine (TMA box [1, BLOCK_N, BLOCK_K] of the
    [E, N, K] descriptor, zero-filled past the edges; the int64 ``expert`` as its int32 coordinate) or through
    pointers (masked on a ragged K)."""
    if USE_TMA:
        return tl.trans(tl.reshape(desc.load([expert.to(tl.int32), n0, k0]), [BLOCK_N, BLOCK_K]))
    elif EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=k_ok[:, None], other=0.0)


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, w_desc, bias_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, max_blocks, N, K, top_k, up_offset, col_step,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_om,
    HAS_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, USE_TMA: tl.constexpr, CLAMP: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
    UP_SHIFT: tl.constexpr,
):
    pid_m, pid_n, idle = _tile_ids(max_blocks, N, num_padded_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if idle:
        return
    expert, rows, pairs, live, n0, offs_n, cols = _block_tile(sorted_ptr, block_expert_ptr, pid_m, pid_n, col_step,
                                                              num_pairs, N, BLOCK_M, BLOCK_N)
    tokens = tl.where(live, pairs // top_k, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_base = w_ptr + expert * stride_we
    g_ptrs = w_base + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    u_ptrs = g_ptrs + up_offset * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        if EVEN_K:
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=live[:, None] & k_ok[None, :], other=0.0)
        g = _b_tile(g_ptrs, w_desc, expert, n0, k0, k_ok, EVEN_K, USE_TMA, BLOCK_N, BLOCK_K)
        acc_g = _mma(a, g, acc_g, UPCAST)
        if HAS_GATE:
            u = _b_tile(u_ptrs, w_desc, expert, n0 + up_offset, k0, k_ok, EVEN_K, USE_TMA, BLOCK_N, BLOCK_K)
            acc_u = _mma(a, u, acc_u, UPCAST)
        a_ptrs += BLOCK_K * stride_xk
        g_ptrs += BLOCK_K * stride_wk
        u_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        b_base = bias_ptr + expert * stride_be
        acc_g += tl.load(b_base + cols * stride_bn).to(tl.float32)[None, :]
        if HAS_GATE:
            acc_u += tl.load(b_base + (cols + up_offset) * stride_bn).to(tl.float32)[None, :]
    if HAS_GATE:
        act = _glu(acc_g, acc_u, ACT, CLAMP, LIMIT, ALPHA, UP_SHIFT)
    else:
        act = _act(acc_g, ACT)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, cast_out(act, out_ptr.dtype.element_ty, UPCAST), mask=offs_n[None, :] < N)


@triton.jit
def down_kernel(
    a_ptr, w_ptr, w_desc, bias_ptr, weight_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, max_blocks, N, K,
    stride_am, stride_we, stride_wn, stride_wk, stride_be, stride_bn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, USE_TMA: tl.constexpr,
):
    pid_m, pid_n, idle = _tile_ids(max_blocks, N, num_padded_ptr, BLOCK_M, BLOCK_N, GROUP_M)
    if idle:
        return
    expert, rows, pairs, live, n0, offs_n, cols = _block_tile(sorted_ptr, block_expert_ptr, pid_m, pid_n, 1,
                                                              num_pairs, N, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # padding rows of the activation hold finite values (GEMM 1 wrote zeros-in → zeros-out): no row mask
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        if EVEN_K:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        w = _b_tile(w_ptrs, w_desc, expert, n0, k0, k_ok, EVEN_K, USE_TMA, BLOCK_N, BLOCK_K)
        acc = _mma(a, w, acc, UPCAST)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + cols * stride_bn).to(tl.float32)[None, :]
    route_w = tl.load(weight_ptr + pairs, mask=live, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    y_ptrs = y_ptr + pairs.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, cast_out(acc, y_ptr.dtype.element_ty, UPCAST), mask=live[:, None] & (offs_n[None, :] < N))


#: interpreter-only paths: operands through fp32 (``_mma``), bf16 rounding on the bits (``_cast``)
_UPCAST = interpreting()


def _weight_descriptor(w: torch.Tensor, n: int, k: int, w_strides: tuple[int, int, int], cfg: GemmConfig,
                       col_step: int = 1):
    """A host-side TMA descriptor of ``w`` viewed as [E, n, k] when ``cfg.tma`` asks and the view allows it
    (k contiguous, columns consecutive, 16-byte aligned base and strides); else None (pointer loads)."""
    stride_e, stride_n, stride_k = w_strides
    if not cfg.tma or stride_k != 1 or col_step != 1 or w.data_ptr() % 16 or (stride_e * w.element_size()) % 16 \
            or (stride_n * w.element_size()) % 16:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(w, [w.shape[0], n, k], [stride_e, stride_n, 1], [1, cfg.block_n, cfg.block_k])


def _grid(plan: RoutingPlan, n: int, cfg: GemmConfig) -> tuple[int]:
    return (plan.max_blocks * triton.cdiv(n, cfg.block_n),)


def gate_up(x: torch.Tensor, w: torch.Tensor, plan: RoutingPlan, cfg: GemmConfig, *, inter: int,
            w_strides: tuple[int, int, int], up_offset: int, col_step: int, has_gate: bool,
            bias: torch.Tensor | None = None, bias_strides: tuple[int, int] = (0, 0),
            activation: str = "silu", glu=None) -> torch.Tensor:
    """GEMM 1 over ``plan``: ``[max_rows, inter]`` activations in plan-row order (see module docstring).

    ``w_strides`` = (expert, output column, reduction) strides of ``w`` in elements; ``inter`` = output
    columns after the gate (I); ``glu``: a ``gates.ClampedGlu`` replacing ``act(gate) · up``."""
    hidden = x.shape[1]
    out = torch.empty(plan.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    desc = _weight_descriptor(w, inter * (2 if has_gate else 1), hidden, w_strides, cfg, col_step)
    gate_up_kernel[_grid(plan, inter, cfg)](
        x, w, desc, bias if bias is not None else w, out, plan.sorted_pairs, plan.block_expert, plan.num_padded,
        plan.num_pairs, plan.max_blocks, inter, hidden, plan.top_k, up_offset, col_step,
        x.stride(0), x.stride(1), *w_strides, *bias_strides, out.stride(0),
        HAS_GATE=has_gate, HAS_BIAS=bias is not None, ACT=ACTIVATIONS[activation],
        EVEN_K=hidden % cfg.block_k == 0, BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, UPCAST=_UPCAST, USE_TMA=desc is not None, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **glu_constexprs(glu))
    return out


def down(act: torch.Tensor, w: torch.Tensor, weights: torch.Tensor, plan: RoutingPlan, cfg: GemmConfig, *,
         hidden: int, w_strides: tuple[int, int, int], bias: torch.Tensor | None = None,
         bias_strides: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """GEMM 2 over ``plan``: ``y [T·k, hidden]`` = routing weight × (act · Wd[e]) in (token, k) row order."""
    inter = act.shape[1]
    y = torch.empty(plan.num_pairs, hidden, dtype=act.dtype, device=act.device)
    desc = _weight_descriptor(w, hidden, inter, w_strides, cfg)
    down_kernel[_grid(plan, hidden, cfg)](
        act, w, desc, bias if bias is not None else w, weights.reshape(-1), y, plan.sorted_pairs, plan.block_expert,
        plan.num_padded, plan.num_pairs, plan.max_blocks, hidden, inter,
        act.stride(0), *w_strides, *bias_strides, y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=inter % cfg.block_k == 0, BLOCK_M=plan.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST=_UPCAST, USE_TMA=desc is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
