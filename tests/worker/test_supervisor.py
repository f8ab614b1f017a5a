"""The pod entrypoint and the supervisor with real processes: probes before/after ready, SIGTERM drain,
a killed rank, a rank that cannot start."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.timing import hold
from .serving_helpers import Server, free_port, greedy_reference

PROBE_KEYS = ("prefetch_restarts", "group_attempt", "forwards", "last_forward_age_s")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "m", seed=5)


def _pod_env(*, pod_index: int, store_port: int, http_port: int) -> dict:
    return {
        "DWDP_JOB": "t", "DWDP_NAMESPACE": "test", "DWDP_GROUP": "0", "DWDP_POD_INDEX": str(pod_index),
        "DWDP_RANK_BASE": str(pod_index), "DWDP_GPUS_PER_POD": "1", "DWDP_SIZE": "2",
        "DWDP_STORE_ADDR": "127.0.0.1", "DWDP_STORE_PORT": str(store_port), "DWDP_ATTEMPT": "3",
        "DWDP_TOKEN": "test-token", "DWDP_NUM_EXPERTS": "8", "DWDP_EXPERTS_PER_WORKER": "4",
        "DWDP_PREFETCH_STRIDE": "4", "DWDP_PREFETCH_SLOTS": "2", "DWDP_CONTENTION_OPT": "false",
        "DWDP_TRANSFER": "copy_engine", "DWDP_MODEL": "", "DWDP_MODEL_SYNTHETIC": "qwen3_moe",
        "DWDP_DTYPE": "float32", "DWDP_BACKEND": "auto", "DWDP_HTTP_PORT": str(http_port),
    }


def _start_pod(pod_index: int, store_port: int) -> Server:
    port = free_port()
    return Server(["pod", "--host", "127.0.0.1"], port=port,
                  env=_pod_env(pod_index=pod_index, store_port=store_port, http_port=port))


def test_two_pods_form_a_group_probes_before_and_after_ready_then_a_pod_crash_fails_the_other(tmp_path):
    from dwdp_worker.checkpoint.synth import write_synthetic

    store_port = free_port()
    pod0 = _start_pod(0, store_port)
    pod1 = None
    try:
        # Pod 0 alone cannot finish: its rank waits in the rendezvous for DWDP rank 1 (pod 1).
        deadline = time.monotonic() + 90
        body = None
        while time.monotonic() < deadline:
            body = pod0.wait_for("/healthz", status=503, timeout_s=90)
            if body["ranks"][0]["phase"] in ("rendezvous", "loading"):
                break
            time.sleep(0.1)
        hold(1.0, "a window in which pod 0 must stay unready without its peer")
        for path in ("/healthz", "/readyz"):
            r = pod0.get(path)
            assert r.status_code == 503, r.text
            body = r.json()
            assert all(k in body for k in PROBE_KEYS), body
            assert body["status"] == "starting" and body["ready"] is False and body["group_attempt"] == 3
            assert body["ranks"][0]["phase"] in ("rendezvous", "loading") and body["ranks"][0]["rank"] == 0
            assert any("loading" in why or "rendezvous" in why for why in body["reasons"])
        r = pod0.post({"prompt": [1, 2, 3]})
        assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]
        assert "dwdp_ready 0.0" in pod0.get("/metrics").text

        pod1 = _start_pod(1, store_port)
        ready0 = pod0.wait_for("/readyz", timeout_s=120)
        ready1 = pod1.wait_for("/readyz", timeout_s=120)
        assert ready0["status"] == ready1["status"] == "ready"
        assert [rk["rank"] for rk in ready0["ranks"] + ready1["ranks"]] == [0, 1]
        assert ready1["group_attempt"] == 3 and ready1["forwards"] >= 1 and ready1["last_forward_age_s"] is not None
        assert pod0.get("/healthz").status_code == 200

        # Both pods serve the same seeded synthetic checkpoint: the same answer as unsharded transformers.
        ckpt = write_synthetic("qwen3_moe", tmp_path / "same", seed=0, num_experts=8, dtype="float32")
        want, _, _ = greedy_reference(ckpt, [4, 8, 15, 16, 23, 42], 2)
        for pod in (pod0, pod1):
            r = pod.post({"prompt": [4, 8, 15, 16, 23, 42], "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want
        # Pod 1 crashes (its ranks die with it): pod 0's rank notices through the group store's
        # heartbeats, and pod 0 exits non-zero naming the lost rank (the operator restarts the group).
        pod1_ranks = pod1.rank_pids()
        pod1.signal(signal.SIGKILL)
        assert pod1.wait_exit(10) == -signal.SIGKILL
        t0 = time.monotonic()
        assert pod0.wait_exit(60) == 1, pod0.log()
        assert time.monotonic() - t0 < 30
        assert "rank 1" in pod0.log() and "stopped heart-beating" in pod0.log(), pod0.log()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pod1_ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pod1_ranks), "a rank outlived its crashed pod supervisor"
    finally:
        pod0.close()
        if pod1:
            pod1.close()


#: a copy delay per prefetch (the runtime's test hook) that stretches a 300-token request from ~0.5 s to ~3 s on
#: the 2-core machine: long enough to still be running after the SIGTERM or the kill and the test's probes on a
#: loaded CI machine (the model allows 512 positions, so more tokens cannot do it)
SLOW_STEPS = {"DWDP_TEST_COPY_DELAY_S": "0.005"}


def _long_request(server: Server, out: dict, max_tokens: int) -> threading.Thread:
    def run():
        out["response"] = server.post({"prompt": [3, 1, 4, 1, 5], "max_tokens": max_tokens})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while server.get("/readyz").json().get("inflight", 0) < 1:
        assert time.monotonic() < deadline, "the long request never became in-flight"
        time.sleep(0.01)
    return t


def test_sigterm_drains_inflight_then_exits_zero(model_dir):
    srv = Server(["--local", "--model", str(model_dir), "--dwdp-size", "2", "--backend", "host"], env=SLOW_STEPS)
    try:
        srv.wait_for("/readyz")
        out: dict = {}
        t = _long_request(srv, out, max_tokens=300)
        srv.signal(signal.SIGTERM)
        body = srv.wait_for("/readyz", status=503, timeout_s=5)
        assert body["status"] == "draining" and body["draining"] is True and body["ready"] is False
        # the server's own record that the long request was still admitted when it began draining
        assert body["inflight"] >= 1, body
        assert all(k in body for k in PROBE_KEYS)
        assert srv.get("/healthz").status_code == 200  # still alive: finishing admitted work
        r = srv.post({"prompt": [1, 2]})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        t.join(60)
        resp = out["response"]
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"][0]["token_ids"]) == 300
        assert srv.wait_exit(60) == 0, srv.log()
    finally:
        srv.close()


def test_killed_rank_answers_503_and_supervisor_exits_nonzero(model_dir):
    import os

    srv = Server(["--local", "--model", str(model_dir), "--dwdp-size", "2", "--backend", "host"], env=SLOW_STEPS)
    try:
        srv.wait_for("/readyz")
        pids = srv.rank_pids()
        out: dict = {}
        t = _long_request(srv, out, max_tokens=400)
        os.kill(pids[1], signal.SIGKILL)
        t.join(60)
        resp = out["response"]
        assert resp.status_code == 503, resp.text
        assert "rank 1" in resp.json()["error"]["message"]
        code = srv.wait_exit(60)
        assert code != 0
        log = srv.log()
        assert "rank 1" in log and "exited unexpectedly" in log and "Traceback" not in log.split("dwdp-worker: error")[-1]
        for pid in pids:  # the surviving rank was stopped too
            assert not _alive(pid), f"rank pid {pid} outlived its supervisor"
    finally:
        srv.close()


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_rank_that_cannot_load_fails_the_front_with_its_reason(tmp_path):
    from dwdp_worker.checkpoint.synth import write_synthetic

    ckpt = write_synthetic("qwen3_moe", tmp_path / "broken", seed=1)
    weights = next(ckpt.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])  # truncated checkpoint
    srv = Server(["--local", "--model", str(ckpt), "--dwdp-size", "2", "--backend", "host"])
    try:
        code = srv.wait_exit(120)
        log = srv.log()
        assert code == 1, log
        assert "exited unexpectedly" in log and "rank" in log
    finally:
        srv.close()
