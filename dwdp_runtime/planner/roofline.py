"""Per-operator roofline: ``T_op = max(F / P_peak, B / BW_mem)``, summed over the ops of a layer.

Pure arithmetic (no torch). Conventions, each an assumption the docs repeat:
  * a GEMM ``[m, k] @ [k, n]`` costs ``F = 2·m·k·n`` and moves ``B = m·k·a + k·n·w + m·n·a`` bytes:
    activations (``a`` = 2, bf16) read once and written once, the weight read once at its storage
    size ``w`` (bytes/element incl. quantisation scales). Caches and tiling re-reads are ignored.
  * attention is causal self-attention over ``seq`` tokens per sequence with a fused (flash) kernel:
    ``pairs = seq·(seq+1)/2`` (query i sees keys 0..i), ``F = 2·heads·(d_qk + d_v)·pairs`` per
    sequence (Q·Kᵀ and P·V), bytes = Q, K, V read and O written once. It runs at the bf16 peak.
    MLA in the context phase is computed non-absorbed: K and V are expanded per head.
  * grouped expert GEMMs: ``routes`` = routed (token, expert) pairs processed, weights of the
    ``touched`` experts (those with >= 1 token) read once. Under uniform routing a token picks
    ``top_k`` distinct experts of ``E``, so one expert is missed by one token with probability
    exactly ``1 - top_k/E`` and ``touched = E_pool·(1 - (1 - top_k/E)^tokens)``.
  * elementwise ops (RMSNorm, SwiGLU, MoE permute/finalize) are memory-bound: F = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_shapes import ModelShape
from .presets import ACT_BYTES, Hardware, WeightDtype, get_dtype


@dataclass(frozen=True)
class Op:
    name: str
    flops: float
    bytes: float
    peak_flops: float
    mem_bw: float

    @property
    def t_compute(self) -> float:
        return self.flops / self.peak_flops if self.flops else 0.0

    @property
    def t_memory(self) -> float:
        return self.bytes / self.mem_bw

    @property
    def time(self) -> float:
        """Roofline time in seconds."""
        return max(self.t_compute, self.t_memory)

    @property
    def bound(self) -> str:
        return "compute" if self.t_compute >= self.t_memory else "memory"


def total_time(ops: list[Op]) -> float:
    return sum(op.time for op in ops)


def gemm(name: str, m: float, k: int, n: int, *, w_bytes: float, peak: float, bw: float) -> Op:
    """``[m, k] @ [k, n]`` with a stored weight of ``w_bytes`` per element."""
    return Op(name, 2.0 * m * k * n, m * k * ACT_BYTES + k * n * w_bytes + m * n * ACT_BYTES, peak, bw)


def grouped_gemm(name: str, routes: float, k: int, n: int, *, touched: float, w_bytes: float,
                 peak: float, bw: float) -> Op:
    """Grouped GEMM over ``touched`` experts, ``routes`` rows in total, each ``[·, k] @ [k, n]``."""
    return Op(name, 2.0 * routes * k * n, routes * k * ACT_BYTES + touched * k * n * w_bytes + routes * n * ACT_BYTES,
              peak, bw)


def elementwise(name: str, read_elems: float, write_elems: float, *, bw: float) -> Op:
    return Op(name, 0.0, (read_elems + write_elems) * ACT_BYTES, 1.0, bw)


def expected_touched(*, pool_experts: float, num_experts: int, top_k: int, tokens: float) -> float:
    """Expected experts of a pool of ``pool_experts`` receiving >= 1 of ``tokens`` tokens."""
    if tokens <= 0:
        return 0.0
    return pool_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def attention_core(*, seq: float, batch: int, heads: int, kv_heads: int, qk_dim: int, v_dim: int,
                   peak: float, bw: float) -> Op:
    pairs = seq * (seq + 1) / 2.0
    flops = batch * 2.0 * heads * (qk_dim + v_dim) * pairs
    elems = batch * seq * (heads * qk_dim + kv_heads * qk_dim + kv_heads * v_dim + heads * v_dim)
    return Op("attention.core", flops, elems * ACT_BYTES, peak, bw)


def layer_ops(shape: ModelShape, hw: Hardware, *, dtype: WeightDtype | str, seq: float, batch: int,
              moe: bool, pool_experts: float | None = None, route_tokens: float | None = None,
              dense_dtype: WeightDtype | str | None = None) -> list[Op]:
    """The ops of one decoder layer on one rank holding ``batch`` sequences of ``seq`` tokens.

    ``moe``: whether this layer is a MoE layer. For MoE layers, ``pool_experts`` is how many experts
    this rank computes (all ``E`` for DWDP, ``E/d`` for DEP) and ``route_tokens`` how many tokens,
    across the ranks that route into that pool, may pick them (``T`` for DWDP, ``d·T`` for DEP);
    the rank then processes ``routes = route_tokens·top_k·pool_experts/E`` (token, expert) pairs.
    ``dtype`` applies to expert weights, ``dense_dtype`` (default: ``dtype``) to the other linears;
    the router stays bf16.
    """
    dt = get_dtype(dtype)
    ddt = get_dtype(dense_dtype) if dense_dtype is not None else dt
    bw = hw.hbm_bytes_per_s
    p_bf16, p_dense, p_exp = hw.peak("bf16"), hw.peak(ddt.compute), hw.peak(dt.compute)
    h, t = shape.hidden, seq * batch
    ops: list[Op] = [elementwise("norm.attn", t * h, t * h, bw=bw)]
    for i, (din, dout) in enumerate(shape.attention_linear_dims()):
        ops.append(gemm(f"attention.proj{i}", t, din, dout, w_bytes=ddt.bytes_per_element, peak=p_dense, bw=bw))
    kv_heads = shape.num_heads if shape.is_mla else shape.num_kv_heads
    ops.append(attention_core(seq=seq, batch=batch, heads=shape.num_heads, kv_heads=kv_heads,
                              qk_dim=shape.qk_dim, v_dim=shape.v_dim, peak=p_bf16, bw=bw))
    ops.append(elementwise("norm.ffn", t * h, t * h, bw=bw))
    if not moe:
        i_d = shape.dense_inter
        ops += [gemm("dense.gate_up", t, h, 2 * i_d, w_bytes=ddt.bytes_per_element, peak=p_dense, bw=bw),
                elementwise("dense.act", t * 2 * i_d, t * i_d, bw=bw),
                gemm("dense.down", t, i_d, h, w_bytes=ddt.bytes_per_element, peak=p_dense, bw=bw)]
        return ops
    e, k_top, i_m = shape.num_experts, shape.top_k, shape.moe_inter
    pool = e if pool_experts is None else pool_experts
    rt = t if route_tokens is None else route_tokens
    routes = rt * k_top * pool / e
    touched = expected_touched(pool_experts=pool, num_experts=e, top_k=k_top, tokens=rt)
    ops.append(gemm("moe.router", t, h, e, w_bytes=ACT_BYTES, peak=p_bf16, bw=bw))
    if shape.shared_inter:
        s_i = shape.shared_inter
        ops += [gemm("moe.shared.gate_up", t, h, 2 * s_i, w_bytes=dt.bytes_per_element, peak=p_exp, bw=bw),
                elementwise("moe.shared.act", t * 2 * s_i, t * s_i, bw=bw),
                gemm("moe.shared.down", t, s_i, h, w_bytes=dt.bytes_per_element, peak=p_exp, bw=bw)]
    ops += [elementwise("moe.permute", routes * h, routes * h, bw=bw),
            grouped_gemm("moe.experts.gate_up", routes, h, 2 * i_m, touched=touched,
                         w_bytes=dt.bytes_per_element, peak=p_exp, bw=bw),
            elementwise("moe.experts.act", routes * 2 * i_m, routes * i_m, bw=bw),
            grouped_gemm("moe.experts.down", routes, i_m, h, touched=touched,
                         w_bytes=dt.bytes_per_element, peak=p_exp, bw=bw),
            elementwise("moe.finalize", routes * h, t * h, bw=bw)]
    return ops


def head_ops(shape: ModelShape, hw: Hardware, *, seq: float, batch: int) -> list[Op]:
    """Embedding lookup for every token and the LM head for the last token of each sequence
    (the context phase samples one token). Both bf16."""
    bw = hw.hbm_bytes_per_s
    t = seq * batch
    return [elementwise("embedding", t * shape.hidden, t * shape.hidden, bw=bw),
            gemm("lm_head", batch, shape.hidden, shape.vocab, w_bytes=ACT_BYTES, peak=hw.peak("bf16"), bw=bw)]
