"""The plan-row passes of the CuTe FP8 path (``fp8_plan_rows``) under Triton's interpreter, and the whole
plan-row MoE composition (``fp8_cute.plan_rows_moe_forward``) with the block-scaled GEMM's contract computed
by the torch block math — the same composition the GPU runs with the CuTe kernel (tests/gpu checks that one).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dwdp_runtime.quant import fp8_block

from .fp8_reference import fp8_moe_reference

plan_rows = pytest.importorskip("dwdp_runtime.kernels.fp8_plan_rows")
fp8_cute = pytest.importorskip("dwdp_runtime.kernels.fp8_cute")
from dwdp_runtime.kernels import gates  # noqa: E402
from dwdp_runtime.kernels.fp8_quant import quantize_groups, quantize_groups_reference  # noqa: E402
from dwdp_runtime.kernels.routing import align_routing  # noqa: E402


def _plan(t, k, e, seed, dropped=()):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, e, (t, k), generator=g)
    for pair in dropped:
        ids.view(-1)[pair] = e + 7  # outside [0, E): dropped by the plan
    return ids, align_routing(ids, e, fp8_cute.TILE_M), g


def test_gather_puts_each_pairs_token_in_its_plan_row():
    t, k, e, h = 37, 2, 5, 384
    ids, plan, g = _plan(t, k, e, 0, dropped=(7,))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    xq, xs = quantize_groups(x)
    a, sa = plan_rows.gather_plan_rows(xq, xs, plan)
    used = int(plan.num_padded)
    pairs = plan.sorted_pairs[:used].long()
    live = pairs < t * k
    tokens = pairs[live] // k
    assert a.shape == (plan.sorted_pairs.numel(), h) and sa.shape == (3, plan.sorted_pairs.numel())
    assert torch.equal(a[:used][live].view(torch.uint8), xq[tokens].view(torch.uint8))
    assert torch.equal(sa[:, :used][:, live], xs[tokens].t())
    # padding rows are zeros with scale 0: they add nothing to a GEMM
    assert not a[:used][~live].view(torch.uint8).any() and not sa[:, :used][:, ~live].any()
    assert int(live.sum()) == t * k - 1


def test_act_quant_is_the_activation_quantization_rule():
    t, k, e, inter = 20, 2, 3, 256
    ids, plan, g = _plan(t, k, e, 1)
    rows = plan.sorted_pairs.numel()
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(torch.bfloat16)
    h, hs = plan_rows.act_quant_plan_rows(gate_up, plan, inter)
    used = int(plan.num_padded)
    gate, up = gate_up[:used, :inter].float(), gate_up[:used, inter:].float()
    act = gate * torch.sigmoid(gate) * up
    qr, sr = quantize_groups_reference(act)
    assert torch.equal(h[:used].view(torch.uint8), qr.view(torch.uint8))
    assert torch.equal(hs[:, :used], sr.t())


def test_reduce_sums_each_tokens_weighted_rows_in_fixed_order():
    t, k, e, hidden = 19, 3, 4, 160
    ids, plan, g = _plan(t, k, e, 2, dropped=(0, 20))
    rows = plan.sorted_pairs.numel()
    y = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    w = torch.rand(t, k, generator=g)
    out = plan_rows.reduce_plan_rows(y, plan, w)
    pos = plan.row_of_pair  # the inverse of sorted_pairs, -1 for the dropped pairs
    assert int((pos < 0).sum()) == 2 and sorted(pos[pos >= 0].tolist()) == sorted(
        r for r in range(int(plan.num_padded)) if int(plan.sorted_pairs[r]) < t * k)
    assert all(int(plan.sorted_pairs[pos[p]]) == p for p in range(t * k) if pos[p] >= 0)
    want = torch.zeros(t, hidden)
    for p in range(t * k):
        if pos[p] >= 0:
            want[p // k] += w.view(-1)[p] * y[pos[p]].float()
    assert torch.equal(out, want.to(torch.bfloat16))


def block_math_gemm(a, sa, w, ws, block_expert, out_dtype=torch.bfloat16):
    """The block-scaled grouped GEMM's contract in torch (float32, bf16 out): live blocks only."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=out_dtype)
    for blk in range(block_expert.numel()):
        e = int(block_expert[blk])
        if e < 0:
            continue
        rows = slice(blk * 128, (blk + 1) * 128)
        acc = torch.zeros(128, w.shape[1])
        for kb in range(a.shape[1] // 128):
            ks = slice(kb * 128, (kb + 1) * 128)
            part = a[rows, ks].float() @ w[e][:, ks].float().t()
            acc += part * (sa[kb, rows][:, None] * ws[e][:, kb].repeat_interleave(128)[None, :])
        out[rows] = acc.to(out_dtype)
    return out


def block_math_fused_gate_up(a, sa, w1, s1, block_expert, inter, glu=None):
    """The fused gate_up's contract: the fp32 block math, SiLU·mul (``glu``: the clamped SwiGLU,
    ``gates.reference`` in fp32), the ``fp8_quant`` rule per row and group."""
    gu = block_math_gemm(a, sa, w1, s1, block_expert, torch.float32)
    gate, up = gu[:, :inter], gu[:, inter:]
    h = gate * torch.sigmoid(gate) * up if glu is None else gates.reference(gate, up, glu)
    q, s = quantize_groups_reference(h)
    return q, s.t().contiguous()


@pytest.mark.parametrize("fused", [False, True], ids=["gemm1+act_quant", "fused_gate_up"])
@pytest.mark.parametrize("t, h, i", [(13, 256, 128), (40, 384, 256)])
def test_plan_row_composition_matches_the_block_math(t, h, i, fused):
    e, k = 5, 2
    g = torch.Generator().manual_seed(t)
    w1, s1 = fp8_block.quantize(torch.randn(e, 2 * i, h, generator=g) / h ** 0.5, row_segments=(i, i))
    w2, s2 = fp8_block.quantize(torch.randn(e, h, i, generator=g) / i ** 0.5)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    got = fp8_cute.plan_rows_moe_forward(x, ids, w, w1, s1, w2, s2, block_math_gemm, block_math_gemm,
                                         fused_gemm1=block_math_fused_gate_up if fused else None)
    want = fp8_moe_reference(x, ids, w, w1, s1, w2, s2, act=F.silu, plan_rows=True, fused_act=fused)
    # same math; only fp32 summation order differs (matmul blocking), which can move a rare e4m3 rounding
    err = (got.float() - want.float()).abs()
    assert float(err.max()) <= 2 ** -6 * float(want.float().abs().max())
    assert float(err.mean()) <= 2 ** -10 * float(want.float().abs().mean())


def test_cute_path_names_why_it_cannot_run_here():
    why = fp8_cute.unavailable()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and why is None:
        pytest.skip("the CuTe path can run here (tests/gpu/test_fp8_cute_gpu.py covers it)")
    assert isinstance(why, str) and why


def test_backend_choice_is_explicit_and_refuses_unknown_names(monkeypatch):
    from dwdp_runtime.kernels import fp8_moe

    w1 = torch.zeros(2, 256, 128, dtype=torch.float8_e4m3fn)
    w2 = torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)
    for value in ("", "auto", "triton", " Triton "):
        monkeypatch.setenv(fp8_moe.BACKEND_ENV, value)
        assert fp8_moe.chosen_backend(w1, w2) is fp8_moe.Fp8Backend.TRITON  # CPU tensors: the Triton kernels
    monkeypatch.setenv(fp8_moe.BACKEND_ENV, "cute")
    with pytest.raises(RuntimeError, match="cute but the weights are on cpu"):
        fp8_moe.chosen_backend(w1, w2)
    monkeypatch.setenv(fp8_moe.BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match="DWDP_FP8_BACKEND='cutlass'.*auto"):
        fp8_moe.chosen_backend(w1, w2)
