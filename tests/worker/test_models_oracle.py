"""The oracle: DWDP-sharded logits == unsharded `transformers` logits, bitwise on CPU (host backend).

For d in {2, 3, 4} one group of real processes loads every architecture in turn (8 experts; d=2 and d=4
with overlapping ranges, d=3 with 8 % 3 != 0) and runs several forwards of different prompt lengths (the
prefetch schedule runs across forwards), including packed multi-sequence batches. The reference runs the
same packed forwards with plain ``AutoModelForCausalLM.from_pretrained`` in this process, on one thread
like the ranks (GEMM results may depend on the thread count, DWDP must not).
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.oracle_group import one_torch_thread, run_oracle_group

from dwdp_runtime.layout import peer_ranges
from dwdp_worker.model.registry import experts_sites
from dwdp_worker.launch.oracle import Reference

BATCHES = [
    [[5, 17, 42, 3, 99, 7, 8]],
    [[1, 2, 3], list(range(10, 47)), [200]],          # packed: 3 sequences, one of a single token
    [list(range(0, 256, 3))],                          # 86 tokens
    [[9, 9, 9, 9], [255, 0, 128, 64, 32]],
]

# d -> (k, s): ranges for 8 experts
SHARDING = {2: (5, 3),   # [0,5) [3,8)          overlapping
            3: (3, 3),   # [0,3) [3,6) [6,8)    8 % 3 != 0, last range shorter
            4: (3, 2)}   # [0,3) [2,5) [4,7) [6,8)  overlapping
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")


@pytest.fixture(scope="module")
def references(checkpoints):
    """Reference logits per checkpoint per batch, and the experts each MoE layer routed to."""
    with one_torch_thread():
        out = {}
        for name, path, dtype in [(n, p, None) for n, p in checkpoints.items()] + [
                ("qwen3_moe@bfloat16", checkpoints["qwen3_moe"], "bfloat16"),
                ("deepseek_v3@bfloat16", checkpoints["deepseek_v3"], "bfloat16")]:
            ref = Reference(path, dtype=dtype)
            hit: dict[int, set[int]] = {}
            handles = [s.module.register_forward_pre_hook(
                lambda m, args, layer=s.layer: hit.setdefault(layer, set()).update(args[1].flatten().tolist()))
                for s in experts_sites(ref.model)]
            out[name] = ([ref.logits(b) for b in BATCHES], hit)
            for h in handles:
                h.remove()
        return out


@pytest.mark.parametrize("d", sorted(SHARDING))
def test_sharded_logits_equal_unsharded_bitwise(d, checkpoints, references):
    k, s = SHARDING[d]
    # d=2 also: a bf16 checkpoint, a fused-expert checkpoint, and float32 checkpoints run in bfloat16
    # (DeepSeek-V3's score-correction bias must stay float32 then, as from_pretrained keeps it)
    extra = ["qwen3_moe_bf16", "qwen3_moe_fused", "qwen3_moe@bfloat16", "deepseek_v3@bfloat16"]
    names = list(ARCHS) + (extra if d == 2 else [])
    runs = [(f"{n}-d{d}", str(checkpoints[n.split("@")[0]]), k, s, n.split("@")[1] if "@" in n else None)
            for n in names]
    res = run_oracle_group(d, runs, BATCHES)
    ranges = peer_ranges(dwdp_size=d, num_experts=8, num_experts_per_worker=k, num_prefetch_experts=s)
    for name in names:
        want, hit = references[name]
        # the batches route to experts every rank lacks, so the composite's remote part is exercised
        assert all(len(experts) == 8 for experts in hit.values()), (name, hit)
        for rank, value in res.items():
            got = value[f"{name}-d{d}"]
            assert tuple(got["local"]) == ranges[rank]
            assert got["restarts"] == [0] * len(BATCHES)
            assert got["stats"].prefetch_bytes > 0
            for i, (g, w) in enumerate(zip(got["logits"], want)):
                g = torch.from_numpy(g)
                assert g.shape == w.shape == (len(BATCHES[i]), 256)
                assert torch.equal(g, w), (f"{name} d={d} rank {rank} forward {i}: max |diff| "
                                           f"{(g - w).abs().max().item():.3g}")
