"""The HTTP API end to end: the real local launcher (1 group × 2 ranks, host backend, real Engine) on a
tiny synthetic qwen3_moe checkpoint, checked against the unsharded `transformers` answer.

One server serves the whole module; bad requests run against it too and must leave it serving.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from .serving_helpers import Server, greedy_reference

PROMPTS = [[5, 17, 42, 99, 3], [7], [200, 11, 11, 11, 64, 1, 2, 3, 4, 5, 6, 7], [250, 0, 128]]


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(["--local", "--model", str(model_dir), "--groups", "1", "--dwdp-size", "2", "--backend", "host",
                  "--max-num-tokens", "48", "--max-queue", "64", "--batch-wait-ms", "40",
                  "--served-model-name", "tiny"])
    try:
        srv.wait_for("/readyz", timeout_s=120)
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def oracle(model_dir):
    cache = {}

    def get(tokens, steps):
        key = (tuple(tokens), steps)
        if key not in cache:
            cache[key] = greedy_reference(model_dir, tokens, steps)
        return cache[key]

    return get


def _choice(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_token_prompt_matches_unsharded_transformers(server, oracle, prompt):
    ids, lps, tops = oracle(prompt, 3)
    r = server.post({"prompt": prompt, "max_tokens": 3, "logprobs": 3})
    body = r.json()
    c = _choice(r)
    assert c["token_ids"] == ids
    assert c["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-4)
    for got, want in zip(c["logprobs"]["top_logprobs"], tops):
        assert list(got.values()) == pytest.approx([v for _, v in want[:3]], abs=1e-4)
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3}
    t = body["timings"]
    assert t["forwards"] == 3 and len(t["ranks"]) == 3 and t["compute_s"] > 0 and t["total_s"] >= t["compute_s"]
    assert body["model"] == "tiny" and body["object"] == "text_completion"


def test_default_is_one_context_forward(server, oracle):
    ids, _, _ = oracle(PROMPTS[0], 3)
    c = _choice(server.post({"prompt": PROMPTS[0]}))
    assert c["token_ids"] == ids[:1] and c["logprobs"] is None


def test_text_prompt_uses_the_tokenizer(server, model_dir, oracle):
    from dwdp_worker.front.text import encode, load_tokenizer

    tok = load_tokenizer(model_dir)
    prompt = "hello world the expert layer of a model"
    tokens = encode(tok, prompt)
    ids, _, _ = oracle(tokens, 2)
    c = _choice(server.post({"prompt": prompt, "max_tokens": 2, "logprobs": 1}))
    assert c["token_ids"] == ids
    assert c["text"] == tok.decode(ids)
    assert c["logprobs"]["tokens"] == [tok.decode([i]) for i in ids]
    assert list(c["logprobs"]["top_logprobs"][0]) == [tok.decode([ids[0]])]
    assert _choice(server.post({"prompt": tokens, "max_tokens": 2}))["token_ids"] == ids


def test_models_endpoint(server):
    data = server.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["tiny"]
    assert data[0]["max_model_len"] == 64 and data[0]["vocab_size"] == 256 and data[0]["has_tokenizer"] is True


def test_concurrent_requests_are_packed_and_answer_like_sequential(server):
    reqs = [{"prompt": p, "max_tokens": m, "logprobs": 2} for p in PROMPTS for m in (1, 2)]
    sequential = [_choice(server.post(r)) for r in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        responses = list(pool.map(server.post, reqs))
    concurrent = [_choice(r) for r in responses]
    for s, c in zip(sequential, concurrent):
        assert c["token_ids"] == s["token_ids"]
        assert c["logprobs"]["token_logprobs"] == pytest.approx(s["logprobs"]["token_logprobs"], abs=1e-4)
    packed = [max(r.json()["timings"]["batch_sequences"]) for r in responses]
    assert max(packed) >= 2, f"no forward packed two requests: {packed}"
    metrics = server.get("/metrics").text
    assert "dwdp_batch_sequences_bucket" in metrics


BAD_REQUESTS = [
    ("malformed JSON", b'{"prompt": [1, 2', 400, "not valid JSON"),
    ("not an object", b'[1, 2, 3]', 422, "body"),
    ("prompt wrong type", json.dumps({"prompt": 12}).encode(), 422, "prompt"),
    ("token ids mixed with text", json.dumps({"prompt": [1, "2"]}).encode(), 422, "prompt"),
    ("token id as float", json.dumps({"prompt": [1.5]}).encode(), 422, "prompt"),
    ("max_tokens wrong type", json.dumps({"prompt": [1], "max_tokens": "3"}).encode(), 422, "max_tokens"),
    ("negative max_tokens", json.dumps({"prompt": [1], "max_tokens": -1}).encode(), 422, "max_tokens"),
    ("zero max_tokens without echo", json.dumps({"prompt": [1], "max_tokens": 0}).encode(), 400, "echo"),
    ("empty token prompt", json.dumps({"prompt": []}).encode(), 400, "empty"),
    ("empty text prompt", json.dumps({"prompt": ""}).encode(), 400, "empty"),
    ("missing prompt", json.dumps({"max_tokens": 1}).encode(), 422, "prompt"),
    ("too long prompt", json.dumps({"prompt": [1] * 65}).encode(), 400, "positions"),
    ("too long with max_tokens", json.dumps({"prompt": [1] * 60, "max_tokens": 10}).encode(), 400, "positions"),
    ("over max-num-tokens", json.dumps({"prompt": [1] * 40, "max_tokens": 10}).encode(), 400, "max-num-tokens"),
    ("token id out of range", json.dumps({"prompt": [1, 256]}).encode(), 400, "out of range"),
    ("negative token id", json.dumps({"prompt": [-1]}).encode(), 400, "out of range"),
    ("huge token id", json.dumps({"prompt": [2 ** 70]}).encode(), 400, "out of range"),
    ("temperature not 0", json.dumps({"prompt": [1], "temperature": 0.7}).encode(), 400, "temperature"),
    ("logprobs too many", json.dumps({"prompt": [1], "logprobs": 50}).encode(), 422, "logprobs"),
    ("stream not a boolean", json.dumps({"prompt": [1], "stream": "yes"}).encode(), 422, "stream"),
    ("wrong model", json.dumps({"prompt": [1], "model": "gpt-4"}).encode(), 404, "not served"),
]


@pytest.mark.parametrize("name,body,status,needle", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_4xx_with_message_and_engine_keeps_serving(server, oracle, name, body, status, needle):
    pids = server.rank_pids()
    r = server.post(content=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), err
    assert "Traceback" not in r.text
    ids, _, _ = oracle(PROMPTS[1], 1)
    assert _choice(server.post({"prompt": PROMPTS[1]}))["token_ids"] == ids
    assert server.rank_pids() == pids


def test_probes_and_metrics_after_ready(server):
    for path in ("/healthz", "/readyz"):
        r = server.get(path)
        assert r.status_code == 200
        body = r.json()
        for key in ("prefetch_restarts", "group_attempt", "forwards", "last_forward_age_s"):
            assert key in body, (path, body)
        assert body["status"] == "ready" and body["draining"] is False and body["group_attempt"] == 0
        assert body["forwards"] >= 2  # at least the warm-up forward of each rank
        assert [rk["phase"] for rk in body["ranks"]] == ["ready", "ready"]
    before = server.get("/healthz").json()["forwards"]
    _choice(server.post({"prompt": PROMPTS[0], "max_tokens": 2}))
    after = server.get("/healthz").json()
    assert after["forwards"] == before + 2 and after["last_forward_age_s"] < 5
    text = server.get("/metrics").text
    for name in ("dwdp_prefetch_bytes_total", "dwdp_prefetch_wait_seconds_total", "dwdp_prefetch_restarts_total",
                 "dwdp_request_latency_seconds_bucket", "dwdp_queue_depth", "dwdp_forwards_total",
                 'dwdp_requests_total{code="200"}', 'dwdp_rank_ready{rank="1"} 1.0', "dwdp_ready 1.0"):
        assert name in text, name
    prefetch = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("dwdp_prefetch_bytes_total{")]
    assert len(prefetch) == 2 and all(v > 0 for v in prefetch)  # each rank pulled its peer's experts
