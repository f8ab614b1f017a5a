"""One routed-experts forward from Triton kernels: align → GEMM 1 (gather + act·mul) → GEMM 2 (× weight) → reduce.

``fused_experts(hidden [T, H], topk_ids [T, k], topk_weights [T, k], weights, layout)`` returns
``[T, H]`` = ``Σ_j w[t, j] · down_e(act(gate_e(x_t)) · up_e(x_t))`` with ``e = topk_ids[t, j]``: the
function `transformers`' ``grouped_mm`` experts forward computes, for every layout the experts
interface describes (``ExpertsLayout``: fused/interleaved or no gate, ``[E, N, K]`` or transposed
``[E, K, N]`` storage, optional biases).

HBM traffic per forward (T tokens, k, H, I, bf16): hidden read ≈ once per row block that gathers it,
weights once per row block's column sweep (L2 keeps an expert's columns while its GROUP_M blocks pass),
``[rows, I]`` activations written once and read once, ``[T·k, H]`` weighted rows written once and read once,
``[T, H]`` out. Nothing of size ``[T·k, 2I]`` or a gathered ``[T·k, H]`` copy of the input exists.

Invariants: no host synchronisation (grids from shapes, ``routing``); no copy of the weights (pointer +
strides of whatever view is passed, e.g. DWDP's composite tensors); configs come from ``tuning.config_for``
(never tuned inside a forward); batch invariant (``grouped_gemm``, ``reduce``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from . import tuning
from .gates import ClampedGlu
from .support import ACTIVATIONS
from .grouped_gemm import down, gate_up
from .reduce import reduce_topk
from .routing import align_routing


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module stores its weights (the flags `transformers`' experts interface sets)."""

    has_gate: bool = True          # gate_up_proj (gate and up) vs up_proj only
    is_transposed: bool = False    # [E, K, N] storage ("input dim first") instead of [E, N, K]
    is_concatenated: bool = True   # gate_up halves [gate; up] vs interleaved g0 u0 g1 u1 …
    has_bias: bool = False
    activation: str = "silu"
    glu: ClampedGlu | None = None  # a clamped SwiGLU replacing act(gate) · up (gpt-oss, DeepSeek-V4: ``gates``)


@dataclass(frozen=True)
class ExpertWeights:
    """The two projections (and biases) of all E experts, as views: never copied."""

    gate_up: torch.Tensor              # [E, 2I, H] ([E, I, H] without a gate); transposed: [E, H, 2I]
    down: torch.Tensor                 # [E, H, I]; transposed: [E, I, H]
    gate_up_bias: torch.Tensor | None = None  # [E, 2I] (or [E, I])
    down_bias: torch.Tensor | None = None     # [E, H]


def _nk_strides(w: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    s = w.stride()
    return (s[0], s[2], s[1]) if transposed else (s[0], s[1], s[2])


def _strides2(bias: torch.Tensor | None) -> tuple[int, int]:
    return tuple(bias.stride()) if bias is not None else (0, 0)


def _out_in(w: torch.Tensor, transposed: bool) -> tuple[int, int]:
    return (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])


@dataclass(frozen=True)
class _Plan:
    inter: int
    hidden: int
    up_offset: int
    col_step: int
    key1: tuning.ShapeKey
    key2: tuning.ShapeKey


def _plan(num_tokens: int, top_k: int, weights: ExpertWeights, layout: ExpertsLayout, dtype) -> _Plan:
    num_experts = weights.gate_up.shape[0]
    n1, hidden = _out_in(weights.gate_up, layout.is_transposed)
    n2, inter = _out_in(weights.down, layout.is_transposed)
    if layout.has_gate and n1 != 2 * inter or not layout.has_gate and n1 != inter or n2 != hidden:
        raise ValueError(f"expert weights disagree: gate_up {tuple(weights.gate_up.shape)}, down "
                         f"{tuple(weights.down.shape)}, has_gate={layout.has_gate}, "
                         f"is_transposed={layout.is_transposed}")
    if layout.activation not in ACTIVATIONS:
        raise ValueError(f"activation {layout.activation!r} has no fused epilogue; have {sorted(ACTIVATIONS)}")
    if layout.glu is not None and not layout.has_gate:
        raise ValueError("a clamped gated activation needs gate and up projections (has_gate=False)")
    up_offset, col_step = (inter, 1) if layout.is_concatenated else (1, 2)
    load = tuning.load_bucket(num_tokens, top_k, num_experts)
    d = str(dtype).removeprefix("torch.")
    return _Plan(inter, hidden, up_offset, col_step,
                 tuning.ShapeKey("gate_up", inter, hidden, num_experts, top_k, d, load),
                 tuning.ShapeKey("down", hidden, inter, num_experts, top_k, d, load))


def _stage1(x, ids, weights: ExpertWeights, layout: ExpertsLayout, p: _Plan, cfg, counts=None):
    """Routing plan for ``cfg.block_m`` and GEMM 1 over it: (plan, ``[rows, I]`` activations)."""
    plan = align_routing(ids, weights.gate_up.shape[0], cfg.block_m, counts=counts)
    return plan, gate_up(x, weights.gate_up, plan, cfg, inter=p.inter,
                         w_strides=_nk_strides(weights.gate_up, layout.is_transposed), up_offset=p.up_offset,
                         col_step=p.col_step, has_gate=layout.has_gate, activation=layout.activation,
                         glu=layout.glu, bias=weights.gate_up_bias, bias_strides=_strides2(weights.gate_up_bias))


def _stage2(act, topk_weights, weights: ExpertWeights, layout: ExpertsLayout, p: _Plan, plan, cfg):
    """GEMM 2: ``[T·k, H]`` weighted rows in (token, k) order."""
    return down(act, weights.down, topk_weights, plan, cfg, hidden=p.hidden,
                w_strides=_nk_strides(weights.down, layout.is_transposed), bias=weights.down_bias,
                bias_strides=_strides2(weights.down_bias))


def fused_experts(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  weights: ExpertWeights, layout: ExpertsLayout = ExpertsLayout(),
                  counts: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (see module docstring). ``hidden_states`` is cast to the
    weights' dtype, like `transformers`' grouped_mm path does. ``counts``: the fused router's per-chunk expert
    counts (``router.Routed.counts``): the alignment then skips its count kernel."""
    x = hidden_states.to(weights.gate_up.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    p = _plan(x.shape[0], topk_ids.shape[1], weights, layout, x.dtype)
    cfg1 = tuning.config_for(p.key1)
    cfg2 = tuning.with_block_m(tuning.config_for(p.key2), cfg1.block_m)
    plan, act = _stage1(x, topk_ids, weights, layout, p, cfg1, counts=counts)
    y = _stage2(act, topk_weights, weights, layout, p, plan, cfg2)
    return reduce_topk(y, topk_ids, weights.gate_up.shape[0], out_dtype=x.dtype)


@dataclass(frozen=True)
class TuneResult:
    gate_up: tuning.GemmConfig
    down: tuning.GemmConfig
    gate_up_ms: dict      # {GemmConfig: median ms} of every candidate timed (empty when already cached)
    down_ms: dict


def tune_experts(weights: ExpertWeights, layout: ExpertsLayout, *, top_k: int, token_counts: Sequence[int],
                 seed: int = 0, rep_ms: int = 20, wide: bool = False) -> dict[int, TuneResult]:
    """Warm-up tuning (GPU): for each T in ``token_counts``, time the candidates on uniformly routed random
    tokens and cache the choice for T's load bucket. GEMM 1 picks BLOCK_M; GEMM 2 tunes its N-tiling
    under that BLOCK_M (they share one routing plan). Returns {T: TuneResult}."""
    num_experts = weights.gate_up.shape[0]
    dev, dtype = weights.gate_up.device, weights.gate_up.dtype
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for t in token_counts:
        p = _plan(t, top_k, weights, layout, dtype)
        x = torch.randn(t, p.hidden, device=dev, dtype=dtype, generator=gen)
        scores = torch.rand(t, num_experts, device=dev, generator=gen)
        w, ids = torch.topk(scores, top_k, dim=-1)
        if tuning.is_tuned(p.key1) and tuning.is_tuned(p.key2):
            out[t] = TuneResult(tuning.config_for(p.key1), tuning.config_for(p.key2), {}, {})
            continue
        cfg1, ms1 = tuning.tune(p.key1, lambda c: _stage1(x, ids, weights, layout, p, c), rep_ms=rep_ms,
                              wide=wide)
        plan, act = _stage1(x, ids, weights, layout, p, cfg1)
        cfg2, ms2 = tuning.tune(p.key2, lambda c: _stage2(act, w, weights, layout, p, plan, c),
                              block_m=cfg1.block_m, rep_ms=rep_ms, wide=wide)
        out[t] = TuneResult(cfg1, cfg2, ms1, ms2)
    return out


def moe_block(hidden_states: torch.Tensor, gate_weight: torch.Tensor, spec, weights: ExpertWeights,
              layout: ExpertsLayout = ExpertsLayout(), bias: torch.Tensor | None = None) -> torch.Tensor:
    """Router + routed experts of one MoE block in 8 launches — the gate GEMM, the fused router, 3 alignment
    kernels, GEMM 1, GEMM 2, the reduction (`transformers`' Qwen3 router + our experts: 6 + 4 + 3 = 13; its
    DeepSeek-V3 router alone ~15) — and no host sync: ``router.route`` on ``hidden @ gate_weightᵀ``
    (computed as the model does: fp32 operands for sigmoid routers, DeepSeek-V3's ``F.linear`` in fp32), then
    ``fused_experts`` reading the router's chunk counts. ``spec``: ``router.RouterSpec``; ``bias``: DeepSeek-V3's
    ``e_score_correction_bias``. Shared experts are not here (a dense MLP the model adds)."""
    from . import router

    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if spec.score == "sigmoid":
        logits = torch.nn.functional.linear(x.float(), gate_weight.float())
    else:
        logits = torch.nn.functional.linear(x, gate_weight)
    routed = router.route(logits, spec, bias)
    return fused_experts(x, routed.topk_ids, routed.topk_weights, weights, layout, counts=routed.counts)

