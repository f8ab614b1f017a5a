"""The serving path on a GPU: the local launcher with ``--backend cuda`` (2 ranks sharing one GPU,
posix_fd handles) answers like the unsharded transformers model on the same GPU, and with ``--cuda-graphs`` unset
its ranks replay plain prefills from CUDA graphs (the default on GPU ranks, issue #34)."""

from __future__ import annotations

import re
import time

import pytest

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
        first = int(torch.argmax(reference_logits(model_dir, [prompts[0]], device="cuda")[0]))
        # first token only: a plain prefill, its bucket captured at a rank's 2nd forward, then replayed — 8 requests
        # over 2 ranks (any split) replay at least 8 - 2 times
        for _ in range(8):
            r = srv.post({"prompt": prompts[0], "max_tokens": 1})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [first], r.text
        replays = re.compile(r'dwdp_prefill_graph_replays_total\{rank="\d+"\} (\d+)')
        deadline = time.monotonic() + 15  # the counters ride on the ranks' heartbeats
        while sum(int(float(n)) for n in replays.findall(srv.get("/metrics").text)) < 8 - 2:
            assert time.monotonic() < deadline, replays.findall(srv.get("/metrics").text)
            time.sleep(0.5)
        health = srv.get("/healthz").json()
        assert health["ready"] and health["prefetch_restarts"] == 0 and health["forwards"] >= 2
        print("healthz:", health)
    finally:
        srv.close()
