"""DEP and DWDP run the same model: real spawned ranks (gloo all-to-alls for DEP, the host-backend
DWDP runtime with real peer copies for DWDP), the same seeded weights and inputs, against a
single-process dense reference.

* DWDP == reference **bitwise**: a rank runs exactly the reference's ops on its own sequences, only
  the expert tensors are composite views (local allocation + pool pages filled by peer copies).
* DEP ≈ reference (float32, 1e-5): experts see a different batch (tokens of all ranks) and a
  token's output is a sum of per-rank partials, so the summation order differs.
"""

import pytest
import torch

from bench.dep_baseline import dep_bounds
from bench.moe_ranks import correctness_program, draw_lengths
from bench.moe_stack import StackConfig, make_inputs, reference_forward

from ..runtime.group import free_port, run_group

CFG = dict(layers=3, hidden=32, heads=4, experts=8, topk=2, inter=16, seed=3)


@pytest.fixture
def one_thread():
    """The ranks run 1 intra-op thread; the reference must too for a bitwise comparison (the BLAS
    blocking, hence the float32 rounding, depends on the thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _ok(results):
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: v[1] for r, v in results.items()}


@pytest.mark.parametrize("world,seqlens", [
    (2, [[5, 11], [9]]),             # uneven token counts, two packed sequences on rank 0
    (3, [[7], [3, 4, 6], [12]]),     # E=8 over 3 ranks: neither DEP nor DWDP ranges are even
])
def test_dep_and_dwdp_match_the_dense_reference(world, seqlens, one_thread):
    steps = 2
    out = _ok(run_group(correctness_program, world, harness_timeout_s=90, store_port=free_port(),
                        cfg_kw=CFG, seqlens=seqlens, steps=steps, threads=1))
    cfg = StackConfig(**CFG)
    for r in range(world):
        for step in range(steps):
            x = make_inputs(cfg, seqlens[r], rank=r, step=step)
            ref = reference_forward(cfg, x, seqlens[r])
            dwdp, dep = (torch.from_numpy(out[r][m][step]) for m in ("dwdp", "dep"))
            assert dwdp.shape == dep.shape == ref.shape == (sum(seqlens[r]), cfg.hidden)
            assert torch.equal(dwdp, ref), f"rank {r} step {step}: DWDP differs from the reference"
            torch.testing.assert_close(dep, ref, rtol=1e-5, atol=1e-5)
            assert not torch.equal(ref, x)   # the stack really changed the input
    b = dep_bounds(cfg.experts, world)
    for r in range(world):
        st = out[r]
        assert st["dep_range"] == (b[r], b[r + 1])
        # DEP really moved tokens to other ranks and computed pairs it does not own the tokens of
        assert st["dep_stats"]["rows_sent_remote"] > 0
        # DWDP really pulled remote experts through the pool, in order (no restart)
        assert st["dwdp_stats"]["prefetch_bytes"] > 0 and st["dwdp_stats"]["restarts"] == 0
    # every (token, expert) pair was computed exactly once, on the expert's owner
    total_pairs = sum(out[r]["dep_stats"]["pairs_computed"] for r in range(world))
    assert total_pairs == steps * cfg.layers * cfg.topk * sum(map(sum, seqlens))


def test_lengths_draw_matches_its_cv_and_is_shared():
    assert draw_lengths(4096, 0.0, 8, seed=1, step=0) == [4096] * 8
    a = draw_lengths(4096, 0.2, 8, seed=1, step=5)
    assert a == draw_lengths(4096, 0.2, 8, seed=1, step=5) and len(set(a)) > 1
    xs = [n for s in range(300) for n in draw_lengths(4096, 0.2, 8, seed=1, step=s)]
    mean = sum(xs) / len(xs)
    std = (sum((v - mean) ** 2 for v in xs) / len(xs)) ** 0.5
    assert abs(mean / 4096 - 1) < 0.02 and abs(std / mean - 0.2) < 0.02
