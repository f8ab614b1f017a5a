"""``--batch-invariant`` on CPU, under Triton's interpreter: the persistent GEMM and the dispatcher override.

What the interpreter can prove is the structural half of the invariant (bi_matmul's docstring): the tiling,
masks and K order of a row do not depend on M or on the row's place in the batch. The hardware half (an MMA
computes an element the same way wherever it sits in the tile) is tests/gpu/test_batch_invariant_gpu.py's.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _operands(m, n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)  # nn.Linear's [out, in]; the GEMM reads w.t()
    return x, w


@pytest.mark.parametrize("dtype,n,k", [(torch.bfloat16, 200, 96),   # 2 column tiles, a ragged K step
                                        (torch.bfloat16, 300, 128),  # the wide tiling (_tiled_mm), 2 column tiles
                                        (torch.bfloat16, 40, 130),   # the narrow-N (router) tiling
                                        (torch.float32, 72, 1),      # K < BLOCK_K (RoPE's outer product)
                                        (torch.float32, 24, 70)])
def test_a_row_is_the_same_bits_alone_and_anywhere_in_a_batch(dtype, n, k):
    from dwdp_runtime.kernels import bi_matmul

    x, w = _operands(300, n, k, dtype)
    packed = bi_matmul.matmul(x, w.t())  # 3 row tiles: rows land at every position of a tile
    for start, m in ((0, 1), (131, 1), (5, 7), (120, 129), (0, 300)):
        assert torch.equal(bi_matmul.matmul(x[start:start + m], w.t()), packed[start:start + m]), (start, m)
    batched = bi_matmul.matmul(x.view(3, 100, k), w.t().expand(3, k, n))  # bmm: 100-row batches, stride-0 B
    assert torch.equal(batched.reshape(300, n), packed)
    exact = (x.double() @ w.double().t())
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # one rounding of the fp32 sum to the output dtype
    assert ((packed.double() - exact).abs() <= tol * exact.abs() + 1e-6).all()


def test_bias_is_added_in_the_epilogue_and_stays_invariant():
    from dwdp_runtime.kernels import bi_matmul

    x, w = _operands(70, 50, 64, torch.bfloat16, seed=3)
    bias = torch.randn(50).bfloat16()
    got = bi_matmul.matmul(x, w.t(), bias=bias)
    exact = x.double() @ w.double().t() + bias.double()
    assert ((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-6).all()  # half a bf16 ulp: one rounding
    assert torch.equal(bi_matmul.matmul(x[9:10], w.t(), bias=bias), got[9:10])


def test_the_mode_routes_linear_mm_bmm_and_close_restores_torch():
    from dwdp_runtime.kernels import batch_invariant, bi_matmul

    x, w = _operands(33, 48, 64, torch.bfloat16, seed=4)
    bias = torch.randn(48).bfloat16()
    before = torch.nn.functional.linear(x, w, bias)
    with batch_invariant.enable("cpu") as mode:
        assert batch_invariant.active("cpu")
        lin2 = torch.nn.functional.linear(x, w, bias)                 # aten::addmm
        lin3 = torch.nn.functional.linear(x.unsqueeze(0), w)          # aten::matmul -> mm
        bmm = torch.bmm(x.view(3, 11, 64), w.t().expand(3, 64, 48))
        assert mode.calls == {"mm": 1, "addmm": 1, "bmm": 1}
        inner = batch_invariant.enable("cpu")  # nested: shares the registration
        inner.close()
        assert batch_invariant.active("cpu")
        with pytest.raises(RuntimeError, match="not covered"):
            torch.mm(torch.ones(2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64))
    assert not batch_invariant.active("cpu")
    assert torch.equal(lin2, bi_matmul.matmul(x, w.t(), bias=bias))
    assert torch.equal(lin3[0], bi_matmul.matmul(x, w.t()))
    assert torch.equal(bmm.reshape(33, 48), bi_matmul.matmul(x, w.t()))
    assert torch.equal(torch.nn.functional.linear(x, w, bias), before)  # torch's own kernel again
    assert torch.equal(torch.mm(torch.ones(2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64)),
                       torch.full((2, 2), 2, dtype=torch.int64))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_tiny_model_sees_the_same_logits_alone_and_packed(arch, tmp_path):
    """A 2-layer model (bf16) attached with ``batch_invariant=True`` (our GEMM for every dense GEMM, attention run
    per packed sequence): a sequence alone = the same sequence packed with two others, bitwise, at every place
    in the pack; every dense GEMM of the forward went through our kernel; and the model is still the model (the
    logits stay within bf16 rounding of the mode-off ones). Without the per-sequence attention the packed
    forward ran SDPA's masked path, which reduces differently for another total length (CPU, transformers
    5.25: 0.0156 apart, GEMMs invariant or not)."""
    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_worker.launch.oracle import Reference

    extra = {"moe_intermediate_size": 32} if arch != "mixtral" else {}
    ckpt = write_synthetic(arch, tmp_path / "m", seed=5, hidden_size=64, num_layers=2, num_experts=4,
                           intermediate_size=64, dtype="bfloat16", vocab_size=128, num_heads=2, top_k=2, **extra)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    off = Reference(ckpt, experts="eager").logits(prompts)
    ref = Reference(ckpt, experts="eager", batch_invariant=True)
    try:
        mode = ref.attachment.batch_invariant
        packed = ref.logits(prompts)
        reordered = ref.logits([prompts[2], prompts[1], prompts[0]])
        for i, prompt in enumerate(prompts):
            alone = ref.logits([prompt])
            assert torch.equal(alone[0], packed[i]), (arch, i, (alone[0] - packed[i]).abs().max().item())
            assert torch.equal(alone[0], reordered[2 - i]), (arch, i)
        assert sum(mode.calls.values()) >= 2 * (2 * 4 + 1)  # q,k,v,o + router per layer, the LM head
        assert (packed - off).abs().max().item() < 0.1 * off.abs().max().item()
    finally:
        ref.attachment.close()


def test_packed_sequences_are_found_by_their_position_restarts():
    from dwdp_worker.model import attention

    assert attention.segments([0, 1, 2, 0, 1, 0]) == ((0, 3), (3, 5), (5, 6))
    assert attention.segments([4, 5, 6]) == ((0, 3),)            # one sequence, whatever its first position
    assert attention.segments([0, 1, 1, 2]) == ((0, 2), (2, 4))  # a repeat is a restart, as transformers says
    # the mask a sequence gets alone: SDPA skips it unless a sliding window is shorter; eager always builds one
    assert not attention.alone_mask_needed("sdpa", 4096, None)
    assert not attention.alone_mask_needed("sdpa", 4096, 4096)
    assert attention.alone_mask_needed("sdpa", 4097, 4096)
    assert attention.alone_mask_needed("eager", 8, None)


def test_attention_close_restores_transformers_and_other_implementations_are_refused(tmp_path):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model import attention

    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ckpt = write_synthetic("mixtral", tmp_path / "m", seed=7, hidden_size=64, num_layers=1, num_experts=4,
                           intermediate_size=64, dtype="bfloat16", vocab_size=128, num_heads=2, top_k=2)
    one, two = Reference(ckpt, experts=None), Reference(ckpt, experts=None)
    first, second = attention.install_per_sequence(one.model), attention.install_per_sequence(two.model)
    assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "dwdp_batch_invariant", False)
    first.close()
    first.close()  # idempotent
    assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "dwdp_batch_invariant", False)  # still owned by the second
    second.close()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
    assert not one.model._forward_pre_hooks and not one.model._forward_hooks
    one.model.config._attn_implementation = "flex_attention"
    with pytest.raises(attention.BatchInvariantAttentionError, match="flex_attention"):
        attention.install_per_sequence(one.model)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before


def test_the_attachment_owns_the_mode(tmp_path):
    """``Reference(batch_invariant=True)`` (= ``attach``, as ``Engine.build`` calls it): on while attached, its
    forwards go through our GEMM and equal the mode's own logits; ``close`` takes it off."""
    from dwdp_runtime.kernels import batch_invariant
    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_worker.launch.oracle import Reference

    ckpt = write_synthetic("mixtral", tmp_path / "m", seed=7, hidden_size=64, num_layers=2, num_experts=4,
                           intermediate_size=64, dtype="bfloat16", vocab_size=128, num_heads=2, top_k=2)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    ref = Reference(ckpt, experts=None, batch_invariant=True)  # experts=None: close undoes the mode only
    assert batch_invariant.active("cpu")
    mode = ref.attachment.batch_invariant
    got = ref.logits(prompt)
    assert sum(mode.calls.values()) > 0
    ref.attachment.close()
    assert not batch_invariant.active("cpu")
    with batch_invariant.enable("cpu"):
        assert torch.equal(ref.logits(prompt), got)


@pytest.mark.parametrize("m", [1, 37, 300])
def test_the_three_kernels_compute_the_same_bits(m):
    """``_tiled_mm`` (one tile per program, rows read wrapped) and ``bi_matmul_tma._tma_mm`` (operands through TMA descriptors,
    zero-filled past the edges) are the same arithmetic as ``_persistent_mm``: same bits for every M, a ragged
    K included (the bench chooses between them by speed alone); TMA reads both weight layouts."""
    from dwdp_runtime.kernels import bi_matmul

    x, w = _operands(300, 72, 104, torch.bfloat16, seed=m)   # K = 104: 16-byte rows, a ragged last K step
    tile = bi_matmul.config_for(72, 104, torch.bfloat16)
    outs = {}
    for kernel in bi_matmul.Kernel:
        out = torch.empty(1, m, 72, dtype=x.dtype)
        bi_matmul.launch(x[:m].unsqueeze(0), w.t().unsqueeze(0), out, None, tile, 4, kernel)
        outs[kernel] = out
    row_major = torch.empty(1, m, 72, dtype=x.dtype)
    bi_matmul.launch(x[:m].unsqueeze(0), w.t().contiguous().unsqueeze(0), row_major, None, tile, 4,
                     bi_matmul.Kernel.TMA)
    assert torch.equal(outs[bi_matmul.Kernel.PERSISTENT], outs[bi_matmul.Kernel.TILED])
    assert torch.equal(outs[bi_matmul.Kernel.TILED], outs[bi_matmul.Kernel.TMA])
    assert torch.equal(row_major, outs[bi_matmul.Kernel.TMA])
    assert torch.equal(outs[bi_matmul.Kernel.TILED][0], bi_matmul.matmul(x, w.t())[:m])


def test_the_wide_tiling_takes_tma_only_where_the_rows_are_16_byte_multiples():
    """The kernel is part of the M-free tiling: TMA for 16-byte K and N rows, the pointer kernel otherwise; a
    misaligned activation view is copied (same bits as the aligned one), never sent to another kernel."""
    from dwdp_runtime.kernels import bi_matmul

    assert bi_matmul.config_for(512, 256, torch.bfloat16).kernel is bi_matmul.Kernel.TMA
    assert bi_matmul.config_for(512, 250, torch.bfloat16).kernel is bi_matmul.Kernel.TILED
    assert bi_matmul.config_for(500, 256, torch.bfloat16).kernel is bi_matmul.Kernel.TILED
    x, w = _operands(65, 300, 136, torch.bfloat16, seed=7)
    packed = bi_matmul.matmul(x, w.t())
    buf = torch.empty(65 * 136 + 1, dtype=x.dtype)
    shifted = buf[1:].view(65, 136)          # 2-byte offset: TMA cannot read it as it lies
    shifted.copy_(x)
    assert shifted.data_ptr() % bi_matmul.TMA_ALIGN
    assert torch.equal(bi_matmul.matmul(shifted, w.t()), packed)
    assert torch.equal(bi_matmul.matmul(shifted[3:4], w.t()), packed[3:4])
