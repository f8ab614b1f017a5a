"""A frozen store host (SIGSTOP) is detected within stated bounds, and both pods exit 1 (D2, D3).

Two ``dwdp-worker pod`` processes of one rank each form one DWDP group; pod 0's rank hosts the group's
TCPStore. Pod 0's rank is SIGSTOPped while it serves a request (busy):

* pod 1's rank: its peer monitor's store calls hang on the frozen host (the kernel still accepts, nobody
  answers), but its watch thread never waits on the store: it declares the store lost after
  ``PEER_DEAD_AFTER_S`` (+ 2 heartbeat intervals) and pod 1 exits 1 naming it;
* pod 0's front: the frozen rank's heartbeat thread is frozen too, so ``/healthz`` reports the stale
  heartbeat although the rank is busy, the watchdog kills the rank at ``--heartbeat-timeout-s`` and pod 0
  exits 1 within a bound (not after the drain timeout);
* the request that was on the frozen rank gets a 503, never a hang.

Pod 0's heartbeat timeout is set above pod 1's detection bound so that pod 1 meets a *frozen* store
(not one whose host was already killed). Figures are printed with ``-s`` (RELIABILITY.md).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx

from dwdp_worker.rank import timeouts
from tests.timing import LOADED_SLACK_S
from .serving_helpers import Server, free_port, pod_env

HEARTBEAT_TIMEOUT_S = timeouts.PEER_DEAD_AFTER_S + 5   # pod 0: after pod 1 has met the frozen store
PEER_BOUND_S = timeouts.PEER_DEAD_AFTER_S + 2 * timeouts.PEER_HEARTBEAT_S
SLACK_S = LOADED_SLACK_S  # teardown and scheduling


def _start_pod(pod_index: int, store_port: int, args=()) -> Server:
    port = free_port()
    return Server(["pod", "--host", "127.0.0.1", *args], port=port,
                  env=pod_env(job="frozen", pod_index=pod_index, store_port=store_port, http_port=port,
                              extra={"DWDP_TEST_COPY_DELAY_S": "0.03"}))


def test_a_frozen_store_host_is_detected_by_its_peer_and_its_own_front():
    store_port = free_port()
    pod0 = _start_pod(0, store_port, args=("--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)))
    pod1 = _start_pod(1, store_port)
    frozen = None
    try:
        pod0.wait_for("/readyz", timeout_s=120)
        pod1.wait_for("/readyz", timeout_s=120)
        out: dict = {}

        def long_request():
            with httpx.Client(base_url=pod0.url, timeout=HEARTBEAT_TIMEOUT_S + 30) as c:
                try:
                    out["r"] = c.post("/v1/completions", json={"prompt": [3, 1, 4], "max_tokens": 60})
                except httpx.HTTPError as exc:
                    out["r"] = exc

        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not pod0.get("/readyz").json()["ranks"][0]["busy"]:
            assert time.monotonic() < deadline, "pod 0's rank never became busy"
            time.sleep(0.005)
        frozen = pod0.rank_pids()[0]
        os.kill(frozen, signal.SIGSTOP)
        t_stop = time.monotonic()

        stale_seen = None
        exits: dict = {}
        while len(exits) < 2 and time.monotonic() - t_stop < HEARTBEAT_TIMEOUT_S + 3 * SLACK_S:
            for i, pod in enumerate((pod0, pod1)):
                if i not in exits and pod.proc.poll() is not None:
                    exits[i] = (pod.proc.returncode, time.monotonic() - t_stop)
            if stale_seen is None and 0 not in exits:
                try:
                    r = pod0.get("/healthz")
                    if r.status_code == 503:  # stale heartbeat of the busy rank, then the kill
                        stale_seen = time.monotonic() - t_stop
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            time.sleep(0.05)
        t.join(30)
        print(f"\nSIGSTOP of the busy store-host rank: pod 1 exited {exits.get(1)} (bound {PEER_BOUND_S:g} s); "
              f"pod 0 /healthz 503 after {stale_seen} s; pod 0 exited {exits.get(0)} "
              f"(heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s); the in-flight request: "
              f"{getattr(out.get('r'), 'status_code', out.get('r'))}")
        assert 1 in exits and exits[1][0] == 1, pod1.log()
        # not before the store's last round (at most one heartbeat before the SIGSTOP) + PEER_DEAD_AFTER_S
        assert timeouts.PEER_DEAD_AFTER_S - 2 * timeouts.PEER_HEARTBEAT_S < exits[1][1] < PEER_BOUND_S + SLACK_S, exits
        assert "has not answered" in pod1.log(), pod1.log()
        # the probe turns 503 at the heartbeat timeout
        assert stale_seen is not None and stale_seen < HEARTBEAT_TIMEOUT_S + SLACK_S, stale_seen
        assert 0 in exits and exits[0][0] == 1, pod0.log()
        assert exits[0][1] < HEARTBEAT_TIMEOUT_S + SLACK_S, exits
        assert "sent no heartbeat" in pod0.log(), pod0.log()
        r = out["r"]
        assert isinstance(r, httpx.Response) and r.status_code == 503 and "rank" in r.json()["error"]["message"], r
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pod0.close()
        pod1.close()
