"""The MoE layer stack that DWDP, DEP and the dense reference all run (pure torch, no collectives).

One layer::

    h = x + Wo · attn(rms_norm(x))           causal self-attention per sequence (F.scaled_dot_product_attention);
                                             sequences of one rank are packed [T, H] with their lengths
    w, ids = top_k(softmax(Wr · rms_norm(h)))  router (float32), weights renormalised over the top k
    out = h + Σ_j w_j · SwiGLU_{ids_j}(rms_norm(h))   grouped expert MLP, gate_up [E, 2I, H], down [E, H, I]

Who calls what:
  * reference / DWDP: ``full_moe`` with ``[E, ...]`` expert tensors (DWDP passes its composite views),
    every (token, k) pair computed locally, combined by ``combine_pairs`` (a bmm over k: fixed order);
  * DEP (``dep_baseline``): ``expert_pairs`` on the pairs it received for its own experts.

Invariants:
  * Weights are a pure function of ``(StackConfig.seed, layer, expert)``: any rank can generate exactly
    the experts it owns (``expert_weights(lo, hi)``), and the rows for expert e are bitwise the same
    whichever range they were generated in. Inputs are a pure function of ``(seed, rank, step)``.
  * ``expert_mlp`` computes one expert's rows with the same ops whether experts come from a plain
    tensor or a composite view; with the same tokens in the same order its output is bitwise equal
    (DWDP vs reference is checked bitwise by ``tests/bench/test_dep_vs_dwdp.py``).
  * The grouped op is chosen once (``grouped_impl``): ``grouped_mm`` (``F.grouped_mm`` /
    ``torch._grouped_mm``, one kernel for all experts; CUDA) or ``loop`` (one matmul per non-empty
    expert; CPU). Every method in one run uses the same choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    experts: int = 8
    topk: int = 2
    inter: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not a multiple of heads={self.heads}")
        if not 1 <= self.topk <= self.experts:
            raise ValueError(f"topk={self.topk} must be in [1, experts={self.experts}]")
        if min(self.layers, self.inter, self.hidden) < 1:
            raise ValueError("layers, inter and hidden must be >= 1")

    def expert_shapes(self) -> dict[str, tuple[int, int]]:
        return {"gate_up_proj": (2 * self.inter, self.hidden), "down_proj": (self.hidden, self.inter)}

    def hf_config(self) -> dict:
        """This stack as a Hugging Face-style config dict (what ``dwdp plan`` reads)."""
        return {"hidden_size": self.hidden, "num_hidden_layers": self.layers, "vocab_size": 1,
                "tie_word_embeddings": True, "num_experts": self.experts, "num_experts_per_tok": self.topk,
                "moe_intermediate_size": self.inter, "intermediate_size": self.inter,
                "num_attention_heads": self.heads, "num_key_value_heads": self.heads,
                "head_dim": self.hidden // self.heads}


# ------------------------------------------------------------------------------------------ weights
def _gen(device, *key: int) -> torch.Generator:
    seed = 0
    for k in key:
        seed = (seed * 1_000_003 + int(k) + 1) % (1 << 62)
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, *, fan_in: int, device, dtype, key) -> torch.Tensor:
    t = torch.randn(shape, generator=_gen(device, *key), device=device, dtype=torch.float32)
    return t.mul_(fan_in ** -0.5).to(dtype)


def dense_weights(cfg: StackConfig, layer: int, *, device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Replicated (attention + router) weights of one layer: every rank holds all of them."""
    H = cfg.hidden
    return {"qkv": _randn((3 * H, H), fan_in=H, device=device, dtype=dtype, key=(cfg.seed, layer, 1)),
            "o": _randn((H, H), fan_in=H, device=device, dtype=dtype, key=(cfg.seed, layer, 2)),
            "router": _randn((cfg.experts, H), fan_in=H, device=device, dtype=dtype, key=(cfg.seed, layer, 3))}


def fill_experts(cfg: StackConfig, layer: int, name: str, view: torch.Tensor, lo: int, hi: int) -> None:
    """Write experts ``[lo, hi)`` of weight ``name`` into ``view`` (shape ``[hi-lo, *shape]``), one
    expert at a time: a rank never materialises experts it does not own."""
    shape = cfg.expert_shapes()[name]
    which = EXPERT_WEIGHTS.index(name)
    for i, e in enumerate(range(lo, hi)):
        view[i].copy_(_randn(shape, fan_in=shape[1], device=view.device, dtype=view.dtype,
                             key=(cfg.seed, layer, 100 + which, e)))


def expert_weights(cfg: StackConfig, layer: int, lo: int, hi: int, *, device="cpu",
                   dtype=torch.float32) -> dict[str, torch.Tensor]:
    out = {}
    for name, shape in cfg.expert_shapes().items():
        t = torch.empty((hi - lo, *shape), device=device, dtype=dtype)
        fill_experts(cfg, layer, name, t, lo, hi)
        out[name] = t
    return out


def make_inputs(cfg: StackConfig, seqlens: Sequence[int], *, rank: int, step: int, device="cpu",
                dtype=torch.float32) -> torch.Tensor:
    """Packed hidden states ``[sum(seqlens), H]`` of one rank for one step (same on every method)."""
    return _randn((int(sum(seqlens)), cfg.hidden), fan_in=1, device=device, dtype=dtype,
                  key=(cfg.seed, 7_000_000 + rank, step))


# ------------------------------------------------------------------------------------------ compute
def attention(x: torch.Tensor, w: dict[str, torch.Tensor], cfg: StackConfig, seqlens: Sequence[int]) -> torch.Tensor:
    """Residual causal self-attention; sequences of the packed batch never see each other."""
    heads, hd = cfg.heads, cfg.hidden // cfg.heads
    qkv = F.linear(F.rms_norm(x, (cfg.hidden,)), w["qkv"])
    outs, start = [], 0
    for n in seqlens:
        q, k, v = qkv[start:start + n].view(n, 3, heads, hd).permute(1, 2, 0, 3)   # each [heads, n, hd]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        outs.append(o.permute(1, 0, 2).reshape(n, cfg.hidden))
        start += n
    return x + F.linear(torch.cat(outs) if len(outs) > 1 else outs[0], w["o"])


def route(h: torch.Tensor, router: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(normed h, weights [T, k] float32, expert ids [T, k] int64)."""
    hn = F.rms_norm(h, (h.shape[-1],))
    probs = torch.softmax(F.linear(hn, router).float(), dim=-1)
    w, ids = torch.topk(probs, topk, dim=-1)
    return hn, w / w.sum(-1, keepdim=True), ids


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_impl(device, requested: str = "auto") -> str:
    """``grouped_mm`` on CUDA when torch has it, else ``loop``; an explicit request is honoured."""
    if requested != "auto":
        if requested == "grouped_mm" and _grouped_mm_fn() is None:
            raise RuntimeError("this torch has neither F.grouped_mm nor torch._grouped_mm")
        return requested
    return "grouped_mm" if torch.device(device).type == "cuda" and _grouped_mm_fn() is not None else "loop"


def expert_mlp(xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               impl: str) -> torch.Tensor:
    """SwiGLU of rows ``xs`` sorted by expert (``counts[e]`` rows for expert e) → ``[rows, H]``."""
    inter = down.shape[-1]
    if impl == "grouped_mm":
        mm = _grouped_mm_fn()
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gu = mm(xs, gate_up.transpose(-2, -1), offs=offs)
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        return mm(act, down.transpose(-2, -1), offs=offs)
    out = torch.empty((xs.shape[0], down.shape[1]), device=xs.device, dtype=xs.dtype)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gu = xs[start:start + n] @ gate_up[e].t()
            out[start:start + n] = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ down[e].t()
            start += n
    return out


def expert_pairs(x: torch.Tensor, rows: torch.Tensor, local_ids: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, impl: str) -> torch.Tensor:
    """Expert outputs for pairs (row ``rows[p]`` of ``x``, expert ``local_ids[p]``), in pair order."""
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=gate_up.shape[0])
    ys = expert_mlp(x[rows[order]], counts, gate_up, down, impl)
    out = torch.empty_like(ys)
    out[order] = ys
    return out


def combine_pairs(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_j w[t, j]·y[t·k + j] with a fixed reduction order (one bmm)."""
    T, k = w.shape
    return torch.bmm(w.to(y.dtype).unsqueeze(1), y.view(T, k, -1)).squeeze(1)


def full_moe(hn: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, experts: dict[str, torch.Tensor],
             impl: str) -> torch.Tensor:
    """MoE with all ``E`` experts addressable locally (reference: plain tensors; DWDP: composites)."""
    T, k = ids.shape
    rows = torch.arange(T * k, device=hn.device) // k
    y = expert_pairs(hn, rows, ids.reshape(-1), experts["gate_up_proj"], experts["down_proj"], impl)
    return combine_pairs(y, w)


MoeFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def forward(cfg: StackConfig, dense: list[dict[str, torch.Tensor]], x: torch.Tensor, seqlens: Sequence[int],
            moe: MoeFn) -> torch.Tensor:
    """The stack; ``moe(layer, hn, w, ids) → [T, H]`` is the only part that differs per method."""
    for layer in range(cfg.layers):
        x = attention(x, dense[layer], cfg, seqlens)
        hn, w, ids = route(x, dense[layer]["router"], cfg.topk)
        x = x + moe(layer, hn, w, ids)
    return x


def reference_forward(cfg: StackConfig, x: torch.Tensor, seqlens: Sequence[int], *, impl: str = "loop",
                      device="cpu", dtype=torch.float32) -> torch.Tensor:
    """Single process, every expert in one plain tensor: the oracle for both methods."""
    dense = [dense_weights(cfg, l, device=device, dtype=dtype) for l in range(cfg.layers)]
    experts = [expert_weights(cfg, l, 0, cfg.experts, device=device, dtype=dtype) for l in range(cfg.layers)]
    return forward(cfg, dense, x, seqlens, lambda l, hn, w, ids: full_moe(hn, w, ids, experts[l], impl))
