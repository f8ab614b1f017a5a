"""Fused router: gate logits ``[T, E]`` → scores → (group-limited) top-k → renormalised weights, and the routing
alignment's per-chunk expert counts, in ONE launch (issue #34, "small T").

What `transformers` runs after the gate GEMM (Qwen3-MoE, 5.x): ``softmax`` (fp32), ``topk``, ``sum``, ``div``,
``to(bf16)`` — five launches, then our alignment's four (``routing``); DeepSeek-V3's group-limited routing is
about fifteen (sigmoid, add, view/topk(2), sum, topk, zeros, scatter, expand, masked_fill, topk, gather, sum, add,
div, mul). At 1K–4K tokens each launch costs more than its work (HBM traffic of ``[T, E]`` fp32 is 2 MiB at 4K ×
128), and the MoE block spent ~2× its two-GEMM floor there. Here one program owns ``BLOCK_T`` tokens, keeps their
``[BLOCK_T, E]`` scores in registers and writes only ``topk_ids [T, k]`` int32, ``topk_weights [T, k]`` and —
when ``BLOCK_T·k`` is the alignment's chunk of pairs (``routing.chunk_pairs``) — that chunk's expert counts, so
``routing.align_routing(..., counts=…)`` skips its count kernel. No host synchronisation, no atomics.

``RouterSpec`` says which router (``of_module`` reads it off a `transformers` router module):
  * ``softmax``  (Qwen3-MoE, Mixtral, Qwen2-MoE …): p = softmax(logits) in fp32; top-k of p; optional
    renormalisation w /= Σ w; weights in ``weight_dtype`` (Qwen3: the logits' dtype; Mixtral: fp32);
  * ``sigmoid``  (DeepSeek-V3): s = sigmoid(logits); choice = s + e_score_correction_bias; group score = sum of
    the top 2 choices of each of ``num_group`` groups; the best ``topk_group`` groups stay, the others' choices
    are −inf; top-k of the choices; w = s at those experts, w /= (Σ w + 1e-20) when renormalising, × scale.

Contract against `transformers` (tests/kernels/test_router.py on CPU, tests/gpu/test_router_gpu.py):
  * **ids**: the same experts, in the same order for softmax routers (``torch.topk(sorted=True)``: descending);
    for sigmoid routers the same *set* (`transformers` asks ``sorted=False``, whose order is the backend's; ours
    is descending). Exact ties are real with bf16 gate logits (8 mantissa bits: among 128 experts two equal
    logits are common) — torch's tie order is unspecified (CPU and CUDA differ); ours takes the lower expert
    index, so a tied pick may name another expert of the same score. A different pick needs two candidates within the 1–2 fp32 ulps by
    which our reductions may differ (softmax's Σ, the top-2 group sums) — measure zero on real logits, and such a
    token is routed to an equally good expert either way;
  * **weights**: within ``WEIGHT_RTOL`` (fp32: our Σ over E and over k are tree sums, torch's are its own order);
    after a bf16 cast equal or one bf16 step apart.
Batch invariant: a token's outputs depend on its own row only (rows are independent; no cross-row reduction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .routing import EXPERT_TILE, chunk_pairs

#: relative tolerance of the fp32 weights vs `transformers` (a few ulps of the Σ orders)
WEIGHT_RTOL = 4e-6
#: token rows per program when the counts are not fused: [BLOCK_T, E] fp32 of ≤ 8K elements stays in registers
ROUTER_ELEMENTS = 8192
SOFTMAX, SIGMOID = 0, 1
#: DeepSeek-V3's renormalisation guard (transformers: ``topk_weights.sum(-1) + 1e-20``)
SIGMOID_EPS = 1e-20


@dataclass(frozen=True)
class RouterSpec:
    """One router's post-GEMM math (module docstring)."""
    num_experts: int
    top_k: int
    score: str = "softmax"             # "softmax" | "sigmoid"
    renormalize: bool = True
    scale: float = 1.0                 # routed_scaling_factor (sigmoid routers)
    num_group: int = 1                 # group-limited routing (sigmoid routers); 1 = none
    topk_group: int = 1
    weight_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {self.score!r}: softmax or sigmoid")
        if self.num_experts % self.num_group:
            raise ValueError(f"{self.num_experts} experts do not split into {self.num_group} groups")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k={self.top_k} of {self.num_experts} experts")


def of_module(router: Any, logits_dtype: torch.dtype) -> RouterSpec:
    """The ``RouterSpec`` of a `transformers` router module (Qwen3-MoE / Mixtral ``…TopKRouter``, DeepSeek-V3
    ``DeepseekV3TopkRouter``); ``logits_dtype``: the gate GEMM's output dtype (Qwen3 casts the weights to it)."""
    name = type(router).__name__
    if hasattr(router, "e_score_correction_bias"):
        return RouterSpec(router.num_experts, router.top_k, "sigmoid", bool(router.norm_topk_prob),
                          float(router.routed_scaling_factor), int(router.num_group), int(router.topk_group))
    if name.startswith("Mixtral"):
        return RouterSpec(router.num_experts, router.top_k, "softmax", True, weight_dtype=torch.float32)
    return RouterSpec(router.num_experts, router.top_k, "softmax", bool(getattr(router, "norm_topk_prob", True)),
                      weight_dtype=logits_dtype)


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, counts_ptr, T, E, s_lt,
                   SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOP_K: tl.constexpr, K_P2: tl.constexpr, RENORM: tl.constexpr, EPS: tl.constexpr,
                   SCALE: tl.constexpr, E_P2: tl.constexpr, G_P2: tl.constexpr, BLOCK_T: tl.constexpr,
                   WRITE_COUNTS: tl.constexpr):
    block = tl.program_id(0)
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, E_P2)
    live = rows < T
    valid = live[:, None] & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * s_lt + cols[None, :], mask=valid,
                other=-float("inf")).to(tl.float32)
    x = tl.where(live[:, None], x, 0.0)  # rows past T: finite (no inf - inf), never stored
    if SCORE == 0:
        m = tl.max(x, axis=1)
        p = tl.exp(x - m[:, None])
        score = p / tl.sum(p, axis=1)[:, None]
        choice = score
    else:
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = score
        if HAS_BIAS:
            choice = score + tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(valid, choice, -float("inf"))
    if NUM_GROUP > 1:
        group_size = E // NUM_GROUP
        group_of = cols // group_size
        gcols = tl.arange(0, G_P2)
        gscore = tl.full((BLOCK_T, G_P2), -float("inf"), tl.float32)
        for g in tl.static_range(NUM_GROUP):  # sum of the group's top 2 choices (a tie counts twice, as topk's)
            inside = (group_of == g)[None, :] & valid
            c = tl.where(inside, choice, -float("inf"))
            first = tl.max(c, axis=1)
            at = tl.min(tl.where(c == first[:, None], cols[None, :], E_P2), axis=1)
            second = tl.max(tl.where(cols[None, :] == at[:, None], -float("inf"), c), axis=1)
            gscore = tl.where(gcols[None, :] == g, (first + second)[:, None], gscore)
        keep = tl.zeros((BLOCK_T, E_P2), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=1)
            gat = tl.min(tl.where(gscore == best[:, None], gcols[None, :], G_P2), axis=1)
            keep = tl.where(group_of[None, :] == gat[:, None], 1, keep)
            gscore = tl.where(gcols[None, :] == gat[:, None], -float("inf"), gscore)
        choice = tl.where(keep != 0, choice, -float("inf"))
    kcols = tl.arange(0, K_P2)
    top_w = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):  # descending; a tie goes to the lower expert index
        best = tl.max(choice, axis=1)
        at = tl.min(tl.where(choice == best[:, None], cols[None, :], E_P2), axis=1)
        picked = cols[None, :] == at[:, None]
        w = tl.sum(tl.where(picked, score, 0.0), axis=1)
        top_w = tl.where(kcols[None, :] == j, w[:, None], top_w)
        top_i = tl.where(kcols[None, :] == j, at[:, None], top_i)
        choice = tl.where(picked, -float("inf"), choice)
        if WRITE_COUNTS:
            counts += tl.sum((picked & live[:, None]).to(tl.int32), axis=0)
    if RENORM:
        top_w = top_w / (tl.sum(top_w, axis=1)[:, None] + EPS)
    if SCALE != 1.0:
        top_w = top_w * SCALE
    out = rows.to(tl.int64)[:, None] * TOP_K + kcols[None, :]
    smask = live[:, None] & (kcols[None, :] < TOP_K)
    tl.store(ids_ptr + out, top_i, mask=smask)
    tl.store(w_ptr + out, top_w.to(w_ptr.dtype.element_ty), mask=smask)
    if WRITE_COUNTS:
        tl.store(counts_ptr + block * E_P2 + cols, counts)


@dataclass(frozen=True)
class Routed:
    """The router's outputs: what the experts (``topk_ids``, ``topk_weights``) and the alignment (``counts``:
    ``[num_chunks, E_P2]`` per-chunk expert counts of ``routing``, or None when not fused) read."""
    topk_ids: torch.Tensor       # [T, k] int32
    topk_weights: torch.Tensor   # [T, k] spec.weight_dtype
    counts: torch.Tensor | None


def route(logits: torch.Tensor, spec: RouterSpec, bias: torch.Tensor | None = None, *,
          fuse_counts: bool = True) -> Routed:
    """The fused router on gate logits ``[T, E]`` (module docstring). ``bias``: DeepSeek-V3's
    ``e_score_correction_bias [E]`` (sigmoid routers only)."""
    if logits.dim() != 2 or logits.shape[1] != spec.num_experts:
        raise ValueError(f"router logits {tuple(logits.shape)} for {spec.num_experts} experts")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    t, e, k = logits.shape[0], spec.num_experts, spec.top_k
    e_p2 = max(EXPERT_TILE, triton.next_power_of_2(e))
    pairs = chunk_pairs(e)
    fused = fuse_counts and pairs % k == 0 and (pairs // k) & (pairs // k - 1) == 0
    block_t = pairs // k if fused else max(1, min(128, ROUTER_ELEMENTS // e_p2))
    blocks = max(1, triton.cdiv(t, block_t))
    dev = logits.device
    ids = torch.empty(t, k, dtype=torch.int32, device=dev)
    weights = torch.empty(t, k, dtype=spec.weight_dtype, device=dev)
    counts = torch.empty(blocks, e_p2, dtype=torch.int32, device=dev) if fused else None
    if t == 0:
        if counts is not None:
            counts.zero_()  # the alignment's one (empty) chunk
        return Routed(ids, weights, counts)
    use_bias = spec.score == "sigmoid" and bias is not None
    _router_kernel[(blocks,)](logits, bias if use_bias else logits, ids, weights, counts if fused else ids, t, e,
                              logits.stride(0), SCORE=SOFTMAX if spec.score == "softmax" else SIGMOID,
                              HAS_BIAS=use_bias, NUM_GROUP=spec.num_group, TOPK_GROUP=spec.topk_group, TOP_K=k,
                              K_P2=triton.next_power_of_2(k), RENORM=spec.renormalize,
                              EPS=SIGMOID_EPS if spec.score == "sigmoid" else 0.0, SCALE=float(spec.scale),
                              E_P2=e_p2, G_P2=triton.next_power_of_2(spec.num_group), BLOCK_T=block_t,
                              WRITE_COUNTS=fused)
    return Routed(ids, weights, counts)
