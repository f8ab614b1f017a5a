"""Fault injection at the worker level, with real ``dwdp-worker pod`` processes on loopback.

Two pods of one rank each form one DWDP group (DWDP_SIZE=2, DWDP_GPUS_PER_POD=1): pod 0's rank hosts
the group's TCPStore (``DWDP_STORE_PORT``), pod 1's rank connects to it. Faults:

* a stray TCP client (raw garbage) and a TCPStore client without the token (junk keys) on the live
  group's store port → the group keeps serving the oracle's answers;
* a slow copy thread (``DWDP_TEST_COPY_DELAY_S``, a test hook) on one pod → answers still equal the
  oracle, and that pod's ``dwdp_prefetch_wait_seconds_total`` rises with the injected delay;
* SIGKILL of a rank mid-forward (the store host, or the other rank) with clients in flight on both
  pods → every in-flight client gets a 503 (bounded client timeout, never a hang), both pods exit 1
  within a bounded time, and the surviving pod's log names the lost rank or store;
* a rank that never arrives → the pod exits 1 within its ``--rendezvous-timeout-s``, naming it.

Figures (faults injected, time to detect) are printed with ``-s`` and recorded in RELIABILITY.md.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from datetime import timedelta

import httpx
import pytest

from tests.timing import hold
from .serving_helpers import Server, free_port, greedy_reference, pod_env

COPY_DELAY_S = 0.05   # widens forwards for the kill tests
SLOW_COPY_S = 0.2     # the slow-copy fault: larger than a tiny forward's compute, so it cannot hide
CLIENT_TIMEOUT_S = 60.0
PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 7, 7], [100, 3, 250, 9, 1, 2, 3, 4]]
# in-flight requests must outlast the kill: decoding with the KV cache is fast, so ask many tokens
# (steps stay short: timeouts.DECODE_STEP_BUDGET_S)
LONG_TOKENS = 4000


def _pod_env(*, pod_index: int, store_port: int, http_port: int, extra: dict | None = None) -> dict:
    return pod_env(job="faults", pod_index=pod_index, store_port=store_port, http_port=http_port, extra=extra)


def _start_pod(pod_index: int, store_port: int, *, extra_env: dict | None = None, args=()) -> Server:
    port = free_port()
    return Server(["pod", "--host", "127.0.0.1", "--max-new-tokens", str(LONG_TOKENS), *args], port=port,
                  env=_pod_env(pod_index=pod_index, store_port=store_port, http_port=port, extra=extra_env))


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """The unsharded transformers answer for the pods' checkpoint (synthetic qwen3_moe, seed 0, 8 experts)."""
    from dwdp_worker.checkpoint.synth import write_synthetic

    ckpt = write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "same", seed=0, num_experts=8,
                           dtype="float32")
    cache: dict = {}

    def get(tokens, steps):
        key = (tuple(tokens), steps)
        if key not in cache:
            cache[key] = greedy_reference(ckpt, list(tokens), steps)[0]
        return cache[key]

    return get


def _metric(text: str, name: str, rank: str = "0") -> float:
    m = re.search(rf'^{name}\{{rank="{rank}"\}} (\S+)$', text, flags=re.M)
    assert m, f"{name} missing from /metrics:\n{text[:2000]}"
    return float(m.group(1))


def _assert_oracle(pods, oracle) -> None:
    for pod in pods:
        for prompt in PROMPTS:
            r = pod.post({"prompt": prompt, "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == oracle(prompt, 2), (pod.url, prompt)


def _stray_clients(store_port: int):
    """Hit the live store with strangers; returns (faults injected, an idle socket, the stranger store)."""
    from torch.distributed import TCPStore

    faults = 0
    junk = [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)), b"\xff" * 4096,
            b"\x00" + (2**63 - 1).to_bytes(8, "little") + b"k" * 64,  # a huge length claim
            os.urandom(65536)]
    for payload in junk:
        with socket.create_connection(("127.0.0.1", store_port), timeout=5) as s:
            s.sendall(payload)
        faults += 1
    # a half-open stranger that stays connected while the group serves (closed by the caller)
    idle = socket.create_connection(("127.0.0.1", store_port), timeout=5)
    idle.sendall(b"\x01\x02")
    faults += 1
    # a TCPStore client without the token: it can reach the store, not name the group's keys
    stranger = TCPStore("127.0.0.1", store_port, 2, is_master=False, timeout=timedelta(seconds=5))
    for key in ("alive/0", "alive/1", "dwdp/test/faults/0/0/alive/1", "dwdp/test/faults/0/0/x/0",
                "barrier/release/0", ""):
        try:
            stranger.set(key, b"junk" * 64)
            faults += 1
        except Exception:  # noqa: BLE001 - the store may refuse an odd key; that is fine too
            faults += 1
    stranger.set("big", os.urandom(1 << 20))
    stranger.add("counter", 10**9)
    stranger.delete_key("alive/1")
    faults += 3
    return faults, idle, stranger


def _start_inflight(pods, n_per_pod: int, out: list) -> list[threading.Thread]:
    """Long requests (many forwards each) on every pod, so a rank is almost always mid-forward."""

    def run(url, i):
        with httpx.Client(base_url=url, timeout=CLIENT_TIMEOUT_S) as c:
            t0 = time.monotonic()
            try:
                r = c.post("/v1/completions", json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": LONG_TOKENS})
                out.append((url, r.status_code, r.text, time.monotonic() - t0))
            except httpx.HTTPError as exc:
                out.append((url, None, repr(exc), time.monotonic() - t0))

    threads = [threading.Thread(target=run, args=(pod.url, i), daemon=True)
               for pod in pods for i in range(n_per_pod)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 15
    for pod in pods:
        while True:
            body = pod.get("/readyz").json()
            if body.get("inflight", 0) >= n_per_pod and body["ranks"][0]["busy"]:
                break
            assert time.monotonic() < deadline, f"requests never became in-flight on {pod.url}: {body}"
            time.sleep(0.01)
    return threads


def _kill_mid_forward_and_check(pods, victim: int, lost_needle: str) -> dict:
    """SIGKILL the rank of pod ``victim`` while both pods are mid-forward; bounded checks; figures."""
    out: list = []
    threads = _start_inflight(pods, 2, out)
    hold(0.3, "both pods are mid-forward")
    victim_pid = pods[victim].rank_pids()[0]
    # the rank is idle for a moment between the forwards of a long request: catch it inside one (bounded)
    deadline = time.monotonic() + 10
    while not pods[victim].get("/readyz").json()["ranks"][0]["busy"]:
        assert time.monotonic() < deadline, "the victim rank was never seen mid-forward within 10 s"
        time.sleep(0.002)
    t_kill = time.monotonic()
    os.kill(victim_pid, signal.SIGKILL)
    exits = {}
    deadline = t_kill + 40
    while len(exits) < len(pods) and time.monotonic() < deadline:
        for i, pod in enumerate(pods):
            if i not in exits and pod.proc.poll() is not None:
                exits[i] = (pod.proc.returncode, time.monotonic() - t_kill)
        time.sleep(0.02)
    assert len(exits) == len(pods), f"pods still running 40 s after the kill: exited {exits}"
    for t in threads:
        t.join(CLIENT_TIMEOUT_S + 5)
        assert not t.is_alive(), "a client hung past its bounded timeout"
    survivor = pods[1 - victim]
    for i, (code, after) in exits.items():
        assert code == 1, f"pod {i} exited {code}:\n{pods[i].log()}"
    assert exits[victim][1] < 10, exits        # the victim's own front sees the death at once
    assert exits[1 - victim][1] < 30, exits    # the peer: PeerMonitor (10 s silence) or a lost store
    log = survivor.log()
    assert lost_needle in log, log
    assert len(out) == 4, out
    for url, status, body, took in out:
        assert status == 503, (url, status, body)   # an error response, not a hang and not a reset
        assert "error" in body and "rank" in body, body
        assert took < CLIENT_TIMEOUT_S
    return {"victim_exit_s": round(exits[victim][1], 2), "peer_exit_s": round(exits[1 - victim][1], 2),
            "inflight_503": len(out)}


def test_stray_store_clients_and_slow_copy_leave_the_group_correct_then_killing_the_store_host_fails_both(oracle):
    store_port = free_port()
    pod0 = _start_pod(0, store_port)
    pod1 = _start_pod(1, store_port, extra_env={"DWDP_TEST_COPY_DELAY_S": str(SLOW_COPY_S)})
    idle = stranger = None
    try:
        pod0.wait_for("/readyz", timeout_s=120)
        pod1.wait_for("/readyz", timeout_s=120)
        _assert_oracle([pod0, pod1], oracle)

        # stray clients on the live store port: the group keeps serving correct answers
        faults, idle, stranger = _stray_clients(store_port)
        _assert_oracle([pod0, pod1], oracle)
        hold(1.5, "several peer-monitor heartbeats with the strangers around")
        for pod in (pod0, pod1):
            assert pod.get("/readyz").status_code == 200
        _assert_oracle([pod0, pod1], oracle)

        # slow copy thread on pod 1: the same answers, and the stall is visible in pod 1's metrics
        w0 = [_metric(p.get("/metrics").text, "dwdp_prefetch_wait_seconds_total") for p in (pod0, pod1)]
        n, per_request = 0, []
        for prompt in PROMPTS * 4:  # max_tokens 1: exactly one packed forward each (more decode with the cache)
            for pod in (pod0, pod1):
                r = pod.post({"prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == oracle(prompt, 1), r.text
            n += 1  # forwards per pod
            per_request.append(r.json()["timings"]["prefetch_wait_s"])  # pod 1's answer
        w1 = [_metric(p.get("/metrics").text, "dwdp_prefetch_wait_seconds_total") for p in (pod0, pod1)]
        slow, fast = w1[1] - w0[1], w1[0] - w0[0]
        print(f"\nstray-store faults injected: {faults}; prefetch wait over {n} forwards: "
              f"slow pod {slow:.3f} s, normal pod {fast:.3f} s; per request on the slow pod {per_request}")
        assert slow >= 0.5 * n * SLOW_COPY_S, (slow, n)   # ≥ half a delayed copy exposed per forward
        assert slow > 5 * fast, (slow, fast)
        assert abs(sum(per_request) - slow) < 0.05 * slow + 0.01  # the response timings agree with /metrics

        # SIGKILL rank 0 (it hosts the store) mid-forward: both pods exit 1, every in-flight client a 503
        figs = _kill_mid_forward_and_check([pod0, pod1], victim=0, lost_needle="lost the rendezvous store")
        print(f"kill store-host rank mid-forward: {figs}")
    finally:
        if idle:
            idle.close()
        del stranger
        pod0.close()
        pod1.close()


def test_killing_a_rank_mid_forward_fails_its_peer_pod_fast_naming_it():
    store_port = free_port()
    pod0 = _start_pod(0, store_port)
    # the copy delay widens every forward of the victim, so the kill lands inside one
    pod1 = _start_pod(1, store_port, extra_env={"DWDP_TEST_COPY_DELAY_S": str(COPY_DELAY_S)})
    try:
        pod0.wait_for("/readyz", timeout_s=120)
        pod1.wait_for("/readyz", timeout_s=120)
        figs = _kill_mid_forward_and_check([pod0, pod1], victim=1, lost_needle="rank 1")
        assert "stopped heart-beating" in pod0.log(), pod0.log()
        print(f"\nkill rank 1 mid-forward: {figs}")
    finally:
        pod0.close()
        pod1.close()


def test_a_rank_that_never_arrives_is_named_within_the_rendezvous_timeout():
    timeout_s = 4.0
    # pod 0 alone (it hosts the store; rank 1 never comes), and pod 1 alone (no store to reach)
    pods = [_start_pod(0, free_port(), args=("--rendezvous-timeout-s", str(timeout_s))),
            _start_pod(1, free_port(), args=("--rendezvous-timeout-s", str(timeout_s)))]
    try:
        # time from entering the rendezvous (seen on /healthz) to the pod's exit
        t_rdzv: dict = {}
        deadline = time.monotonic() + 90
        while len(t_rdzv) < 2 and time.monotonic() < deadline:
            for i, pod in enumerate(pods):
                if i in t_rdzv:
                    continue
                if pod.proc.poll() is not None:
                    raise AssertionError(f"pod {i} exited before its rendezvous was seen:\n{pod.log()}")
                try:
                    if pod.get("/healthz").json()["ranks"][0]["phase"] in ("rendezvous", "loading"):
                        t_rdzv[i] = time.monotonic()
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
            time.sleep(0.05)
        assert len(t_rdzv) == 2, "a pod never reached its rendezvous"
        codes = [pod.wait_exit(60) for pod in pods]
        took = [round(time.monotonic() - t_rdzv[i], 1) for i in range(2)]  # upper bounds (sequential waits)
        print(f"\nmissing-rank pods exited {codes}, {took} s after entering the rendezvous (timeout {timeout_s} s)")
        assert codes == [1, 1], (pods[0].log(), pods[1].log())
        assert max(took) < timeout_s + 15, took  # the bounded wait + teardown, with slack for 2 loaded cores
        err0, err1 = (_error_line(pod.log()) for pod in pods)
        assert "rank(s) [1] never arrived" in err0, err0
        assert "rank 1 could not reach the rendezvous store" in err1 and "rank 0 hosts it" in err1, err1
        for pod, err in zip(pods, (err0, err1)):  # a readable reason: no Python traceback, no C++ backtrace
            assert "Traceback" not in pod.log(), pod.log()
            assert "frame #" not in err and "Exception raised from" not in err, err
    finally:
        for pod in pods:
            pod.close()


def _error_line(log: str) -> str:
    """The pod's final error (from "dwdp-worker: error:" to the end, minus multiprocessing's own warning)."""
    assert log.count("dwdp-worker: error:") == 1, log
    tail = log[log.index("dwdp-worker: error:"):]
    return "\n".join(line for line in tail.splitlines() if "resource_tracker" not in line and "warnings.warn" not in line)
