"""The KV handoff through the HTTP API: a local DWDP server prefills with ``kv_transfer_params``, this
test process (a separate process, its own NIXL agent) pulls with the reference client and decodes with
plain transformers; budget, 429, caps, metrics and /healthz (docs/KV_TRANSFER.md)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from dwdp_worker.kv.nixl_api import nixl_installed
import torch

from .serving_helpers import Server

# the kv extra installs nixl-cu13, whose module is nixl_cu13 (only the `nixl` meta package provides `nixl`)
if not nixl_installed():
    pytest.skip("KV transfer tests need NIXL (the kv extra)", allow_module_level=True)

from dwdp_worker.kv.client import KvPuller, KvPullError, decode_from_params  # noqa: E402
from dwdp_worker.launch.oracle import Reference  # noqa: E402

BUDGET, BLOCK = 64 * 4096, 4096
PROMPTS = [[5, 17, 42], [9, 1, 200, 33, 7, 64, 120], [3, 250, 11, 90, 18, 6, 77, 140, 2, 8, 51, 99]]


def generate(model, prompt, n):
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def kv_server(checkpoints):
    srv = Server(["--local", "--model", str(checkpoints["mixtral"]), "--groups", "1", "--dwdp-size", "2",
                  "--threads-per-rank", "1", "--kv-budget-bytes", str(BUDGET), "--kv-block-bytes", str(BLOCK),
                  "--kv-ttl-s", "8", "--max-new-tokens", "40"])
    try:
        srv.wait_for("/readyz", timeout_s=240)
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def reference(checkpoints):
    torch.set_num_threads(1)
    return Reference(checkpoints["mixtral"]).model


def test_prefill_here_decode_there_equals_generate(kv_server, reference):
    with KvPuller() as puller:
        for prompt in PROMPTS:
            r = kv_server.post({"prompt": prompt, "max_tokens": 1, "logprobs": 2,
                                "kv_transfer_params": {"do_remote_decode": True}})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            params = choice["kv_transfer_params"]
            assert params["prompt_token_ids"] == prompt and params["seq_len"] == len(prompt)
            assert params["model"] == "mixtral" and params["dwdp_group"] == 0
            # where a decode engine reaches this server: the bound address and port (never a wildcard)
            assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", kv_server.port)
            assert params["protocol"] == "dwdp-kv/2" and params["ttl_s"] == 8 and params["lease_s"] == 30
            assert len(choice["token_ids"]) == 1 and choice["logprobs"]["token_logprobs"]
            pulled = puller.pull(params)
            tokens, _ = decode_from_params(reference, prompt, choice["token_ids"][0], pulled, max_new_tokens=16)
            assert tokens == generate(reference, prompt, 16)
            with pytest.raises(KvPullError, match="already pulled"):
                puller.pull(params)
    plain = kv_server.post({"prompt": PROMPTS[0]}).json()["choices"][0]
    assert plain["kv_transfer_params"] is None


def test_the_cli_is_a_router_flow_in_one_command(kv_server, reference, checkpoints):
    """Another process: prefill over HTTP, pull over NIXL with its own agent, decode with plain transformers."""
    import json
    import subprocess
    import sys

    from .serving_helpers import child_env

    prompt = PROMPTS[2]
    out = subprocess.run([sys.executable, "-m", "dwdp_worker.kv.client", "--url", kv_server.url, "--model",
                          str(checkpoints["mixtral"]), "--prompt-ids", ",".join(map(str, prompt)),
                          "--max-new-tokens", "16"], env=child_env({"OMP_NUM_THREADS": "1"}),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tokens"] == generate(reference, prompt, 16)
    assert (got["remote_host"], got["remote_port"]) == ("127.0.0.1", kv_server.port) and got["verdict_s"] > 0
    assert got["pulled_bytes"] > 0 and got["read_gbps"] > 0 and got["engine"].startswith("dwdp-local-g0-r")


def test_max_tokens_decodes_with_the_cache_and_is_capped(kv_server, reference):
    prompt = PROMPTS[1]
    r = kv_server.post({"prompt": prompt, "max_tokens": 20, "logprobs": 1})   # two steps: 16 + 4 tokens
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == generate(reference, prompt, 20)
    assert len(choice["logprobs"]["token_logprobs"]) == 20
    assert r.json()["timings"]["forwards"] == 20
    r = kv_server.post({"prompt": prompt, "max_tokens": 41})
    assert r.status_code == 400 and "--max-new-tokens=40" in r.text
    r = kv_server.post({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "max_tokens=1" in r.text
    r = kv_server.post({"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True, "typo": 1}})
    assert r.status_code == 422
    r = kv_server.post({"prompt": prompt, "stream": True, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400 and "needs stream=false" in r.text and "kv_transfer_params" in r.text


def test_budget_holds_under_100_concurrent_requests_then_ttl_frees(kv_server):
    body = {"prompt": PROMPTS[2], "kv_transfer_params": {"do_remote_decode": True}}
    exp0 = kv_server.get("/healthz").json()["kv"]["expirations"]   # the earlier tests pulled all they kept
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: kv_server.post(body), range(100)))
    codes = [a.status_code for a in answers]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 1 and codes.count(429) >= 1   # 2 ranks × 64 blocks, 2 blocks per prompt
    assert all("KV budget full" in a.json()["error"]["message"] for a in answers if a.status_code == 429)
    assert all(a.headers.get("retry-after") for a in answers if a.status_code == 429)
    import time

    # rank stats arrive with heartbeats; every answered request's KV is held or, if the burst outlasted the 8 s
    # TTL on a loaded machine, already expired — never lost or double-counted
    deadline = time.monotonic() + 5
    while (kv := kv_server.get("/healthz").json()["kv"])["held_sequences"] + kv["expirations"] - exp0 != \
            codes.count(200):
        assert time.monotonic() < deadline, kv
        time.sleep(0.1)
    assert kv["budget_bytes"] == 2 * BUDGET and kv["held_bytes"] <= kv["budget_bytes"]
    deadline = time.monotonic() + 30                              # nobody pulls: the TTL (8 s) frees them
    while kv_server.get("/healthz").json()["kv"]["held_sequences"] and time.monotonic() < deadline:
        time.sleep(0.2)
    kv = kv_server.get("/healthz").json()["kv"]
    assert kv["held_bytes"] == 0 and kv["expirations"] - exp0 == codes.count(200)
    metrics = kv_server.get("/metrics").text
    assert 'dwdp_kv_budget_bytes{rank="0"}' in metrics and "dwdp_kv_expirations_total" in metrics
    assert "dwdp_kv_pulls_total" in metrics and "dwdp_kv_full_total" in metrics
    assert 'dwdp_requests_total{code="429"}' in metrics


def test_a_wildcard_advertise_host_is_refused_before_any_rank_starts(checkpoints):
    import subprocess
    import sys

    from .serving_helpers import child_env

    out = subprocess.run([sys.executable, "-m", "dwdp_worker.launch.cli", "--local", "--model",
                          str(checkpoints["mixtral"]), "--kv-budget-bytes", str(BUDGET), "--kv-block-bytes", str(BLOCK)],
                         env=child_env({"DWDP_KV_ADVERTISE_HOST": "0.0.0.0"}), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--kv-advertise-host='0.0.0.0' is a wildcard" in out.stderr and "Traceback" not in out.stderr
    assert "started" not in out.stderr            # refused at planning: no rank process was spawned


def test_remote_decode_and_max_tokens_admission():
    from dwdp_worker.front.admission import Limits, Param, new_tokens_fit

    off = Limits(max_num_tokens=64, vocab_size=256, max_positions=64, max_new_tokens=8)
    on = Limits(max_num_tokens=64, vocab_size=256, max_positions=64, max_new_tokens=8, kv_enabled=True)
    assert "KV transfer is off" in new_tokens_fit(1, True, off).message
    assert new_tokens_fit(1, True, off).param is Param.KV_TRANSFER_PARAMS
    assert new_tokens_fit(1, True, on) is None and new_tokens_fit(8, False, off) is None
    assert "max_tokens=1" in new_tokens_fit(2, True, on).message
    too_many = new_tokens_fit(9, False, on)
    assert "--max-new-tokens=8" in too_many.message and too_many.param is Param.MAX_TOKENS
