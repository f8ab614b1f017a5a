"""The serving path on a GPU: the local launcher with ``--backend cuda`` (2 ranks sharing one GPU,
posix_fd handles) answers like the unsharded transformers model on the same GPU, and with ``--cuda-graphs`` unset
its ranks replay plain prefills from CUDA graphs (the default on GPU ranks, issue #34)."""

from __future__ import annotations

import re
import time

import pytest

from dwdp_worker.rank.prefill_graphs import MAX_FAILED_CAPTURES
from tests.timing import DETECTION_S, wait_until

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "m", seed=5)  # no tokenizer: logprob keys are token ids


def test_cuda_local_group_matches_transformers_on_gpu(model_dir):
    import torch

    from dwdp_worker.launch.oracle import reference_logits
    from ..worker.serving_helpers import Server

    srv = Server(["--local", "--model", str(model_dir), "--groups", "1", "--dwdp-size", "2", "--backend", "cuda"])
    try:
        srv.wait_for("/readyz", timeout_s=240)
        prompts = [[5, 17, 42, 99, 3, 8, 1], [200, 11, 11, 64, 1, 2, 3, 4, 5, 6, 7]]
        for p in prompts:
            r = srv.post({"prompt": p, "logprobs": 3})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            ref = reference_logits(model_dir, [p], device="cuda")[0].float()
            logp = torch.log_softmax(ref, -1)
            assert choice["token_ids"][0] == int(torch.argmax(ref))
            got = {int(k): v for k, v in choice["logprobs"]["top_logprobs"][0].items()}
            assert len(got) == 3
            for tok, lp in got.items():
                assert abs(lp - float(logp[tok])) < 1e-3, (tok, lp, float(logp[tok]))
        # this float32 model's experts fall back to transformers' grouped_mm, which copies from the host and cannot be
        # captured: each rank gives graphs up after MAX_FAILED_CAPTURES and keeps answering eagerly (4 plain prefills
        # over 2 ranks: one rank at least reaches a capture)
        first = int(torch.argmax(reference_logits(model_dir, [prompts[0]], device="cuda")[0]))
        for _ in range(4):
            r = srv.post({"prompt": prompts[0], "max_tokens": 1})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [first], r.text
        # the counters ride on the ranks' heartbeats
        metrics = wait_until(lambda: (m := srv.get("/metrics").text)
                             and _metric_sum(m, "dwdp_prefill_graph_failures_total") >= 1 and m,
                             DETECTION_S, "the capture failures in /metrics")
        assert _metric_sum(metrics, "dwdp_prefill_graph_replays_total") == 0
        assert 1 <= _metric_sum(metrics, "dwdp_prefill_graph_failures_total") <= 2 * MAX_FAILED_CAPTURES
        health = srv.get("/healthz").json()
        assert health["ready"] and health["prefetch_restarts"] == 0 and health["forwards"] >= 2
        print("healthz:", health)
    finally:
        srv.close()


def _metric_sum(text: str, name: str) -> int:
    return sum(int(float(v)) for v in re.findall(name + r'\{rank="\d+"\} (\S+)', text))


def test_plain_prefills_replay_from_cuda_graphs_by_default(tmp_path):
    """``--cuda-graphs`` unset on a bf16 model (our Triton experts): each rank captures a shape at its second plain
    prefill and replays it after; every answer is the same token (a replay's logits are its warm-up's bits)."""
    from dwdp_worker.checkpoint.synth import write_synthetic
    from ..worker.serving_helpers import Server

    path = write_synthetic("qwen3_moe", tmp_path / "bf16", seed=5, dtype="bfloat16")
    srv = Server(["--local", "--model", str(path), "--groups", "1", "--dwdp-size", "2", "--backend", "cuda"])
    try:
        srv.wait_for("/readyz", timeout_s=240)
        answers = []
        for _ in range(8):  # 8 plain prefills over 2 ranks (any split) replay at least 8 - 2 times
            r = srv.post({"prompt": [5, 17, 42, 99, 3, 8, 1], "max_tokens": 1})
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["token_ids"])
        assert len({tuple(a) for a in answers}) == 1, answers
        deadline = time.monotonic() + 15  # the counters ride on the ranks' heartbeats
        while _metric_sum(srv.get("/metrics").text, "dwdp_prefill_graph_replays_total") < 8 - 2:
            assert time.monotonic() < deadline, "\n".join(
                [ln for ln in srv.get("/metrics").text.splitlines() if "prefill_graph" in ln]
                + [ln for ln in srv.log().splitlines() if re.search("graph|capture|WARNING|Error", ln)][-40:])
            time.sleep(0.5)
        assert _metric_sum(srv.get("/metrics").text, "dwdp_prefill_graph_failures_total") == 0
    finally:
        srv.close()
