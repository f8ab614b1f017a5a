"""``fused_experts`` under Triton's interpreter against a float64 loop: every layout, ragged shapes, strided views.

Tolerances: float32 weights must land near float32 rounding (the interpreter's dot is float32); bf16
weights are compared with the error of `transformers`' own grouped_mm experts forward on the same inputs
as the yardstick (ours may be at most twice as far from float64, plus bf16's half-ulp).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.kernels.reference import experts_ref, rel_err  # noqa: E402


def _inputs(tokens, hidden, inter, experts, top_k, dtype, seed, *, has_gate=True, transposed=False, bias=False):
    gen = torch.Generator().manual_seed(seed)
    n1 = 2 * inter if has_gate else inter
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, n1, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    if transposed:  # [E, K, N] storage: a transposed *view*, not a copy — strides do the work
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    scores = torch.rand(tokens, experts, generator=gen)
    w, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    b1 = (0.1 * torch.randn(experts, n1, generator=gen)).to(dtype) if bias else None
    b2 = (0.1 * torch.randn(experts, hidden, generator=gen)).to(dtype) if bias else None
    return x, ids, w, gate_up, down, b1, b2


LAYOUTS = {
    "concatenated": dict(),
    "interleaved": dict(concatenated=False),
    "transposed": dict(transposed=True),
    "no_gate": dict(has_gate=False),
    "bias": dict(bias=True),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layouts_float32(layout):
    from dwdp_runtime.kernels import ExpertsLayout, ExpertWeights, fused_experts

    opts = LAYOUTS[layout]
    x, ids, w, gu, dn, b1, b2 = _inputs(29, 64, 48, 6, 2, torch.float32, seed=len(layout),
                                        has_gate=opts.get("has_gate", True), transposed=opts.get("transposed", False),
                                        bias=opts.get("bias", False))
    lay = ExpertsLayout(has_gate=opts.get("has_gate", True), is_transposed=opts.get("transposed", False),
                        is_concatenated=opts.get("concatenated", True), has_bias=opts.get("bias", False))
    got = fused_experts(x, ids, w, ExpertWeights(gu, dn, b1, b2), lay)
    want = experts_ref(x, ids, w, gu, dn, has_gate=lay.has_gate, transposed=lay.is_transposed,
                       concatenated=lay.is_concatenated, gate_up_bias=b1, down_bias=b2)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (40, 64, 32, 8, 2),    # even K
    (23, 72, 40, 5, 3),    # K and N ragged against BLOCK_K / BLOCK_N (masked paths)
    (3, 64, 32, 13, 8),    # fewer tokens than experts; most experts empty
])
def test_bf16_as_close_as_transformers(tokens, hidden, inter, experts, top_k):
    from transformers.integrations.moe import grouped_mm_experts_forward

    from dwdp_runtime.kernels import ExpertWeights, fused_experts

    x, ids, w, gu, dn, _, _ = _inputs(tokens, hidden, inter, experts, top_k, torch.bfloat16, seed=tokens)
    got = fused_experts(x, ids, w, ExpertWeights(gu, dn))
    want = experts_ref(x, ids, w, gu, dn)

    class Mod(torch.nn.Module):  # the attributes transformers' experts forward reads
        num_experts, has_gate, has_bias, is_transposed, has_post_expert_norm = experts, True, False, False, False
        _is_expert_parallel = False
        gate_up_proj, down_proj = gu, dn

        def _apply_gate(self, h):
            g, u = h.chunk(2, dim=-1)
            return torch.nn.functional.silu(g) * u

    theirs = grouped_mm_experts_forward(Mod(), x, ids, w)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) <= 2 * rel_err(theirs, want) + 4e-3


def test_one_expert_takes_every_token_and_strided_composite_view():
    """All tokens on one expert (a long ragged list), weights a strided slice of a larger buffer."""
    from dwdp_runtime.kernels import ExpertWeights, fused_experts

    x, _, _, gu, dn, _, _ = _inputs(45, 64, 32, 4, 1, torch.float32, seed=9)
    big_gu = torch.randn(4, 2 * 32 + 16, 64 + 8)   # the weights live inside a bigger allocation
    big_gu[:, :64, :64] = gu
    view = big_gu[:, :64, :64]
    assert not view.is_contiguous()
    ids = torch.full((45, 1), 2, dtype=torch.long)
    w = torch.rand(45, 1)
    got = fused_experts(x, ids, w, ExpertWeights(view, dn))
    assert rel_err(got, experts_ref(x, ids, w, gu, dn)) < 1e-5


def test_unwritten_rows_are_zero_for_dropped_pairs():
    """Expert ids outside [0, E) contribute nothing (every output element is still written)."""
    from dwdp_runtime.kernels import ExpertWeights, fused_experts

    x, ids, w, gu, dn, _, _ = _inputs(12, 64, 32, 4, 2, torch.float32, seed=4)
    ids = ids.clone()
    ids[::3, 1] = 4  # sentinel
    got = fused_experts(x, ids, w, ExpertWeights(gu, dn))
    assert torch.isfinite(got).all()
    assert rel_err(got, experts_ref(x, ids, w, gu, dn)) < 1e-5


def test_shape_disagreement_is_a_clear_error():
    from dwdp_runtime.kernels import ExpertWeights, fused_experts

    x, ids, w, gu, dn, _, _ = _inputs(4, 64, 32, 4, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="disagree"):
        fused_experts(x, ids, w, ExpertWeights(gu[:, :40], dn))


@pytest.mark.parametrize("layout,hidden", [("concatenated", 64), ("no_gate", 64), ("transposed", 64),
                                           ("concatenated", 72), ("interleaved", 64)])
def test_tma_weight_tiles_equal_pointer_loads(layout, hidden):
    """``GemmConfig(tma=True)`` (weight tiles through a TMA descriptor, zero-filled past the edges) computes
    bitwise what pointer loads compute — ragged K and N included; views TMA cannot describe (interleaved
    columns) quietly take the pointer path."""
    from dwdp_runtime.kernels import ExpertsLayout, ExpertWeights, fused_experts, moe, tuning

    opts = LAYOUTS[layout]
    lay = ExpertsLayout(has_gate=opts.get("has_gate", True), is_transposed=opts.get("transposed", False),
                        is_concatenated=opts.get("concatenated", True))
    x, ids, w, gu, dn, _, _ = _inputs(21, hidden, 40, 5, 2, torch.bfloat16, seed=hidden,
                                      has_gate=lay.has_gate, transposed=lay.is_transposed)
    weights = ExpertWeights(gu, dn)
    plain = fused_experts(x, ids, w, weights, lay)
    p = moe._plan(x.shape[0], 2, weights, lay, x.dtype)
    try:
        for key in (p.key1, p.key2):
            tuning.remember(key, tuning.GemmConfig(block_m=16, block_n=32, tma=True))
        via_tma = fused_experts(x, ids, w, weights, lay)
    finally:
        tuning.forget_all()
    assert torch.equal(via_tma, plain)
