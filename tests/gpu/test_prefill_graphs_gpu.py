"""Prefill from CUDA graphs on a GPU (``pytest -m gpu``): a d = 2 group on CUDA, FP8 checkpoints, the engine
built with ``cuda_graphs=2`` against the same engine eager, the DWDP copies captured with the forward
(worker/dwdp_worker/rank/prefill_graphs.py). A batch runs padded to its bucket (dwdp_runtime/graph_buckets.py):
ONE (512 tokens) is a bucket exactly and OTHER runs unpadded (no graph left for it), so both are bitwise the eager
engine's; PACKED (245 tokens in 3 sequences) runs as 256 tokens, 4 rows: its warm-up, capture and replays are
bitwise each other, and within bf16 rounding of the unpadded eager forward (cuBLAS may tile 245 rows otherwise)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")  # marked gpu and skipped without CUDA by tests/gpu/conftest.py

ARCHS = ("qwen3_moe", "deepseek_v3")
VOCAB = 256  # the synthetic checkpoints' (hidden_size 256)
ONE, PACKED = [[t % VOCAB for t in range(3, 515)]], [[5, 17, 42], list(range(10, 250)), [200, 7]]
OTHER = [[t % 251 for t in range(1, 300)]]
#: bucket ONE: eager, captured, 3 replays; PACKED (3 sequences): eager, captured, a replay; OTHER: eager only
#: (max 2 graphs); then ONE again, replayed after the eager OTHER left fresh copies on the copy stream
BATCHES = [ONE] * 5 + [PACKED] * 3 + [OTHER] * 3 + [ONE] * 2


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    base = tmp_path_factory.mktemp("gpu-graphs")
    return {a: write_synthetic(a, base / a, seed=5, hidden_size=256, moe_intermediate_size=256, num_layers=4,
                               dtype="bfloat16", quant="fp8") for a in ARCHS}


def test_prefill_graphs_replay_the_eager_logits_bitwise(fp8_checkpoints):
    from tests.worker.oracle_group import run_oracle_group

    runs = [(f"{a}-{kind}", str(fp8_checkpoints[a]), 5, 3, None) for a in ARCHS for kind in ("eager", "graphs")]
    res = run_oracle_group(2, runs, BATCHES, backend="auto", gpus=torch.cuda.device_count(), harness_timeout_s=600,
                           cuda_graphs={f"{a}-graphs": 2 for a in ARCHS})
    for rank, value in res.items():
        for a in ARCHS:
            eager, graphs = value[f"{a}-eager"], value[f"{a}-graphs"]
            st = graphs["stats"]
            print(f"{a} rank {rank}: {st.graphs}, "
                  f"restarts {graphs['restarts'][-1]}")
            assert st.backend != "host"
            packed = [n for n, b in enumerate(BATCHES) if b is PACKED]
            for n, (g, w) in enumerate(zip(graphs["logits"], eager["logits"])):
                if n in packed:
                    assert (g == graphs["logits"][packed[0]]).all(), f"{a} rank {rank} forward {n}: not its bucket's"
                    torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * float(abs(w).max()))
                else:
                    assert (g == w).all(), f"{a} rank {rank} forward {n}: max |diff| {abs(g - w).max():.3g}"
            assert st.graphs.captured == 2 and st.graphs.failed == 0
            # ONE: its capture (replayed once for its own output), 3 replays, 2 at the end; PACKED: capture, 1 replay
            assert st.graphs.replayed == (1 + 3 + 2) + (1 + 1)
            assert st.graphs.eager == 1 + 1 + 3
            assert graphs["restarts"][-1] == eager["restarts"][-1] == 0
