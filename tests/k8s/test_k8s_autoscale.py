"""spec.autoscaling on the real API server: a real CPU worker (the local launcher, 1 group × 2 ranks, tiny
synthetic qwen3_moe) stands behind group 0's pod address; load on it makes the operator scale the DwdpGroup
up through the scale subresource, then down once the load is gone and the windows passed — with Events and
``status.autoscaling``; a manual numGroups edit is explained and taken back; bad settings are refused.

The operator here is its own instance (``--namespace dwdp-as-…``, outside the session operator's
``dwdp-t-*``) with ``DWDP_OPERATOR_LOAD_URL`` pointing at a router that forwards a pod's ``/v1/load`` to
the worker registered for it (the test kubelet's pods have no process; only group 0's pod gets one).
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from kubernetes.client.rest import ApiException

from ..worker.serving_helpers import Server
from .conftest import Operator, group_body, release_namespace, wait_for

AUTO = {"minGroups": 1, "maxGroups": 3, "targetTTFTSeconds": 0.3, "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 10, "panicHoldSeconds": 10, "intervalSeconds": 1, "maxStep": 2}
# one pod per group (HGX shape), 2 ranks: the same shape as the local worker behind it
SHAPE = dict(numGroups=1, dwdpSize=2, gpusPerPod=2, imex={"mode": "None"},
             experts={"numExperts": 16, "numExpertsPerWorker": 8, "numPrefetchExperts": 8})
PROMPT = list(range(3, 43))  # 40 tokens: one prompt per forward at --max-num-tokens 48


class LoadRouter:
    """GET /load/<namespace>/<pod> -> the registered worker's /v1/load (404 for a pod with no process)."""

    def __init__(self):
        self.routes: dict[str, str] = {}
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                pod = self.path.rstrip("/").split("/")[-1]
                target = outer.routes.get(pod)
                try:
                    if target is None:
                        raise LookupError(pod)
                    with urllib.request.urlopen(target + "/v1/load", timeout=2) as r:
                        body, code = r.read(), 200
                except Exception:  # noqa: BLE001 — no process behind this pod: what an unreachable pod answers
                    body, code = b"{}", 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.template = f"http://127.0.0.1:{self.httpd.server_address[1]}/load/{{namespace}}/{{pod}}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()


@pytest.fixture(scope="module")
def worker():
    srv = Server(["--local", "--synthetic", "qwen3_moe", "--groups", "1", "--dwdp-size", "2", "--backend", "host",
                  "--max-num-tokens", "48", "--max-queue", "256"], env={"DWDP_TEST_COPY_DELAY_S": "0.01"})
    try:
        srv.wait_for("/readyz", timeout_s=180)
        yield srv
    finally:
        srv.close()


@pytest.fixture
def scaler(cluster, tmp_path):
    """(namespace, router, operator): an operator of its own, reading loads through the router."""
    c = cluster
    ns = f"dwdp-as-{uuid.uuid4().hex[:6]}"
    c.core.create_namespace({"metadata": {"name": ns}})
    router = LoadRouter()
    env = dict(c.operator.env, DWDP_OPERATOR_LOAD_URL=router.template)
    op = Operator(env, tmp_path)
    op.cmd = [a if a != "dwdp-t-*" else ns for a in op.cmd]
    op.start()
    try:
        yield ns, router, op
    finally:
        op.stop()
        router.close()
        release_namespace(c, ns)


def _auto(c, ns, name="auto") -> dict:
    return (c.get_group(ns, name).get("status") or {}).get("autoscaling") or {}


def _events(c, ns, reason):
    return [e.message for e in c.events(ns, reason)]


def test_load_scales_up_then_down_after_the_window(cluster, scaler, worker):
    c, (ns, router, op) = cluster, scaler
    c.create_group(ns, group_body("auto", **SHAPE, autoscaling=AUTO))
    wait_for(lambda: (c.get_group(ns, "auto").get("status") or {}).get("readyGroups") == 1, timeout=60,
             what="group 0 ready")
    router.routes["auto-g0-p0"] = worker.url
    wait_for(lambda: _auto(c, ns).get("reason") == "NoSignal", timeout=30,
             what="the autoscaler deciding before any forward was measured")

    stop = threading.Event()

    def hammer():
        with httpx.Client(base_url=worker.url, timeout=60) as http:
            while not stop.is_set():
                http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(8)]
    t_load = time.time()
    for t in threads:
        t.start()
    try:
        wait_for(lambda: c.get_group(ns, "auto")["spec"]["numGroups"] >= 2, timeout=90, interval=0.5,
                 what="numGroups raised by the autoscaler under load")
        t_up = time.time() - t_load
        # the pass scales first and writes its status after: the numGroups above can be seen before its decision
        st = wait_for(lambda: (s := _auto(c, ns)).get("reason") in ("PanicScaleUp", "ScaleUp")
                      and s.get("desiredGroups", 0) >= 2 and s, timeout=15, interval=0.2,
                      what="status.autoscaling of the scale-up decision")
        assert st["signals"]["pods"] == 1 and st["signals"]["offeredLoad"] > 0 and st["loadErlangs"] > 0, st
        assert st["lastScaleTime"] and st["waitBudgetSeconds"] > 0
        up = wait_for(lambda: _events(c, ns, "AutoscaleUp"), timeout=30, what="an AutoscaleUp Event")
        assert "numGroups 1 ->" in up[0], up
        wait_for(lambda: (c.get_group(ns, "auto").get("status") or {}).get("readyGroups", 0) >= 2, timeout=60,
                 what="the added group ready")
        peak = c.get_group(ns, "auto")["spec"]["numGroups"]
    finally:
        stop.set()
        for t in threads:
            t.join(70)
    t_stop = time.time()
    # the load is gone: after the panic hold and the down window, back to minGroups, groups drained away
    wait_for(lambda: c.get_group(ns, "auto")["spec"]["numGroups"] == 1, timeout=240, interval=1,
             what="numGroups back to 1 after the window")
    t_down = time.time() - t_stop
    down = wait_for(lambda: _events(c, ns, "AutoscaleDown"), timeout=30, what="an AutoscaleDown Event")
    assert any("ScaleDown" in m for m in down), down
    wait_for(lambda: not c.live_pods(ns, "dwdp.io/name=auto,dwdp.io/group notin (0)"), timeout=60,
             what="the scaled-away groups' pods deleted (drained)")
    assert _auto(c, ns)["reason"] in ("ScaleDown", "Hold")
    assert "autoscaled" in op.log()
    print(f"\nFIGURE autoscale: 8 closed-loop clients on a real CPU worker -> numGroups 1 -> {peak} in {t_up:.1f}s "
          f"({up[0][:120]}); load stopped -> back to 1 in {t_down:.1f}s (panic hold 10 s, down window 10 s)")


def test_a_manual_edit_is_explained_and_taken_back(cluster, scaler, worker):
    c, (ns, router, _) = cluster, scaler
    c.create_group(ns, group_body("auto", **SHAPE, autoscaling={**AUTO, "scaleDownStabilizationSeconds": 2}))
    wait_for(lambda: (c.get_group(ns, "auto").get("status") or {}).get("readyGroups") == 1, timeout=60,
             what="group 0 ready")
    router.routes["auto-g0-p0"] = worker.url
    worker.post({"prompt": PROMPT, "max_tokens": 1})  # one forward measured: a signal, no load
    wait_for(lambda: _auto(c, ns).get("reason") == "Hold", timeout=60, what="a measured, idle fleet")
    c.kubectl("scale", "dwdpgroup/auto", "--replicas=3", "-n", ns)
    msgs = wait_for(lambda: _events(c, ns, "ManualScaleOverridden"), timeout=30, what="the override explained")
    assert "spec.numGroups was set to 3 outside the autoscaler" in msgs[0] and "remove spec.autoscaling" in msgs[0]
    wait_for(lambda: c.get_group(ns, "auto")["spec"]["numGroups"] == 1, timeout=90, interval=0.5,
             what="the autoscaler's numGroups again")


def test_bad_settings_are_refused_or_explained(cluster, ns):
    c = cluster
    with pytest.raises(ApiException) as e:  # the OpenAPI schema: exclusiveMinimum 0
        c.create_group(ns, group_body("zero", **SHAPE, autoscaling={**AUTO, "targetTTFTSeconds": 0}))
    assert e.value.status == 422 and "targetTTFTSeconds" in e.value.body
    # min > max: CEL at admission on >= 1.25; this 1.20 server takes it and the operator explains it
    c.create_group(ns, group_body("minmax", **SHAPE, autoscaling={**AUTO, "minGroups": 3, "maxGroups": 2}))
    cond = wait_for(lambda: (x := c.condition(ns, "minmax", "Invalid")) and x["status"] == "True" and x,
                    timeout=30, what="Invalid condition")
    assert "spec.autoscaling.minGroups=3 is above spec.autoscaling.maxGroups=2" in cond["message"]
    assert any("minGroups=3" in m for m in _events(c, ns, "InvalidSpec"))
    assert not c.live_pods(ns, "dwdp.io/name=minmax")
