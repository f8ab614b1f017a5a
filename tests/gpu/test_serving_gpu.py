"""The serving path on a GPU: the local launcher with ``--backend cuda`` (2 ranks sharing one GPU,
posix_fd handles) answers like the unsharded transformers model on the same GPU."""

from __future__ import annotations

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
        health = srv.get("/healthz").json()
        assert health["ready"] and health["prefetch_restarts"] == 0 and health["forwards"] >= 2
        print("healthz:", health)
    finally:
        srv.close()
