"""Roofline arithmetic pinned on the toy model (tests/planner/toy.py), derived by hand."""

import math

import pytest

from dwdp_runtime.planner import roofline
from dwdp_runtime.planner.presets import DTYPES

from .planner_toy import TOY, toy_gpu


def test_op_is_max_of_compute_and_memory():
    op = roofline.Op("x", flops=300.0, bytes=20.0, peak_flops=100.0, mem_bw=10.0)
    assert op.time == 3.0 and op.bound == "compute"       # 300/100 = 3 > 20/10 = 2
    op = roofline.Op("x", flops=100.0, bytes=50.0, peak_flops=100.0, mem_bw=10.0)
    assert op.time == 5.0 and op.bound == "memory"        # 1 < 50/10 = 5


def test_gemm_flops_and_bytes():
    # [3, 2] @ [2, 5], bf16 weight: F = 2*3*2*5 = 60; B = 3*2*2 + 2*5*2 + 3*5*2 = 12 + 20 + 30 = 62
    op = roofline.gemm("g", 3, 2, 5, w_bytes=2, peak=1, bw=1)
    assert (op.flops, op.bytes) == (60, 62)


def test_expected_touched_experts():
    # one token, top-1 of 2 experts: exactly one expert is touched
    assert roofline.expected_touched(pool_experts=2, num_experts=2, top_k=1, tokens=1) == pytest.approx(1.0)
    # 3 tokens: an expert is missed by all with (1/2)^3 = 1/8 -> 2 * 7/8 = 1.75
    assert roofline.expected_touched(pool_experts=2, num_experts=2, top_k=1, tokens=3) == pytest.approx(1.75)
    # top-2 of 2: every token touches both
    assert roofline.expected_touched(pool_experts=2, num_experts=2, top_k=2, tokens=1) == pytest.approx(2.0)


def test_causal_attention_core():
    # seq 3 -> pairs (i, j<=i) = 1 + 2 + 3 = 6; F = 2 * heads(1) * (2 + 2) * 6 = 48
    # bytes: 3 tokens * (q 2 + k 2 + v 2 + o 2) elems * 2 B = 48
    op = roofline.attention_core(seq=3, batch=1, heads=1, kv_heads=1, qk_dim=2, v_dim=2, peak=100, bw=10)
    assert (op.flops, op.bytes) == (48, 48)
    # quadratic: doubling the sequence multiplies FLOPs by 2*(2*3+1)... exactly 2 * 7*6/2 / 6 = 3.5
    op2 = roofline.attention_core(seq=6, batch=1, heads=1, kv_heads=1, qk_dim=2, v_dim=2, peak=100, bw=10)
    assert op2.flops / op.flops == pytest.approx(21 / 6)


def test_toy_moe_layer_memory_bound_total():
    """Toy GPU: 100 FLOP/s, 10 B/s. seq 3, batch 1 -> T = 3 tokens, H = 2. Every op is memory-bound:

    norm.attn     read 3*2 + write 3*2 elems = 12 * 2 B = 24 B            -> 2.4 s
    4 projections [3,2]@[2,2]: B = 12 + 8 + 12 = 32 (F = 24 -> 0.24 s)   -> 4 * 3.2 = 12.8 s
    attention     48 B (F 48)                                             -> 4.8 s
    norm.ffn                                                              -> 2.4 s
    router        [3,2]@[2,2] bf16                                        -> 3.2 s
    routes = 3 tokens * top-1 * (2/2 experts) = 3; touched = 1.75 experts
    permute       read 3*2 + write 3*2 elems -> 24 B                      -> 2.4 s
    gate_up       [3,2]@1.75x[2,2]: 12 + 1.75*4*2 + 12 = 38 B             -> 3.8 s
    act (SwiGLU)  read 3*2 + write 3*1 = 9 elems -> 18 B                  -> 1.8 s
    down          [3,1]@1.75x[1,2]: 6 + 1.75*2*2 + 12 = 25 B              -> 2.5 s
    finalize      read 3*2 routes + write 3*2 tokens = 12 elems -> 24 B   -> 2.4 s
    total = 38.5 s
    """
    ops = roofline.layer_ops(TOY, toy_gpu(), dtype="bf16", seq=3, batch=1, moe=True)
    assert [o.bound for o in ops] == ["memory"] * len(ops)
    assert roofline.total_time(ops) == pytest.approx(38.5)


def test_toy_moe_layer_compute_bound_total():
    # infinite-ish bandwidth: only FLOPs count. 4 projections * 24 + attention 48 + router 24
    # + gate_up 2*3*2*2 = 24 + down 2*3*1*2 = 12  = 204 FLOP at 100 FLOP/s = 2.04 s
    ops = roofline.layer_ops(TOY, toy_gpu(bw=1e15), dtype="bf16", seq=3, batch=1, moe=True)
    assert roofline.total_time(ops) == pytest.approx(2.04, rel=1e-9)


def test_dep_pool_reads_fewer_experts():
    # DEP with d = 2: this rank runs 1 of 2 experts for the routes of both ranks (6 tokens):
    # routes = 6 * 1 * 1/2 = 3, touched = 1 * (1 - (1/2)^6) = 63/64
    ops = {o.name: o for o in roofline.layer_ops(TOY, toy_gpu(), dtype="bf16", seq=3, batch=1, moe=True,
                                                 pool_experts=1, route_tokens=6)}
    gu = ops["moe.experts.gate_up"]
    assert gu.flops == 2 * 3 * 2 * 2
    assert gu.bytes == pytest.approx(3 * 2 * 2 + (63 / 64) * 2 * 2 * 2 + 3 * 2 * 2)


def test_quantised_bytes_per_element():
    assert DTYPES["bf16"].bytes_per_element == 2
    assert DTYPES["nvfp4"].bytes_per_element == 0.5 + 1 / 16          # E2M1 + one E4M3 scale per 16
    assert DTYPES["fp8"].bytes_per_element == 1 + 4 / (128 * 128)      # + one fp32 scale per 128x128


def test_dense_layer_uses_dense_ffn():
    # dense FFN on a toy with intermediate 1: gate_up [3,2]@[2,2], act, down [3,1]@[1,2]; no router
    names = [o.name for o in roofline.layer_ops(TOY, toy_gpu(), dtype="bf16", seq=3, batch=1, moe=False)]
    assert "moe.router" not in names and names[-3:] == ["dense.gate_up", "dense.act", "dense.down"]
    assert math.isfinite(roofline.total_time(roofline.head_ops(TOY, toy_gpu(), seq=3, batch=1)))
