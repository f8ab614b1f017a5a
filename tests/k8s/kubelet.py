"""A tiny test "kubelet" for the test control plane (which has no real kubelet).

What it does, from one watch of all pods (plus a periodic sweep for missed events):
  1. a pod bound to a node (``spec.nodeName``) and still Pending becomes Running + Ready with
     ``podIP`` 127.0.0.1 (loopback only: nothing may contact pod networks in tests);
  2. a pod with a ``deletionTimestamp`` is confirmed deleted (grace 0), as a kubelet would after
     its containers stop;
  3. on request: ``fail(ns, name)`` sets phase Failed; ``bump_restart(ns, name)`` adds one
     container restart; ``hold(ns, name)`` keeps a pod Pending
     (every pod of that name, until ``release``).
It also creates fake GPU ``Node`` objects (``make_nodes``) and serves a fake ``/healthz`` on
127.0.0.1 (``HealthServer``) whose ``prefetch_restarts`` tests can set per pod.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

CLIQUE_LABEL = "nvidia.com/gpu.clique"
#: seconds a list / patch / delete may wait for the API server: a request caught by an API-server restart
#: must fail (the loops retry) rather than wait forever and leave every later pod Pending
CALL_TIMEOUT_S = 10
#: the pod watch's server-side timeout; its client read limit is this plus CALL_TIMEOUT_S
WATCH_S = 30


def make_nodes(core: client.CoreV1Api, *, cliques: int = 4, per_clique: int = 4, gpus: int = 4) -> list[str]:
    names = []
    for c in range(cliques):
        for n in range(per_clique):
            name = f"gpu-c{c}-n{n}"
            names.append(name)
            body = {"apiVersion": "v1", "kind": "Node",
                    "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                          CLIQUE_LABEL: f"clique-uuid.{c}"}}}
            try:
                core.create_node(body)
            except ApiException as e:
                if e.status != 409:
                    raise
            core.patch_node(name, {"spec": {"taints": None}})  # the server adds not-ready at creation
            cap = {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": str(gpus)}
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            core.patch_node_status(name, {"status": {
                "capacity": cap, "allocatable": cap,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                "message": "test kubelet", "lastHeartbeatTime": now, "lastTransitionTime": now}]}})
    return names


def _pinned(patch: dict, pod) -> dict:
    """A merge patch that only applies to the pod version it was computed from (else 409)."""
    return {**patch, "metadata": {"resourceVersion": pod.metadata.resource_version}}


def _running_status(pod, restarts: int = 0) -> dict:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cs = [{"name": c.name, "ready": True, "restartCount": restarts, "image": c.image,
           "imageID": "docker://test", "started": True, "state": {"running": {"startedAt": now}}}
          for c in pod.spec.containers]
    return {"status": {
        "phase": "Running", "podIP": "127.0.0.1", "hostIP": "127.0.0.1", "startTime": now,
        "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                       for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")],
        "containerStatuses": cs}}


class Kubelet:
    def __init__(self, api: client.ApiClient):
        self.core = client.CoreV1Api(api)
        self._stop = threading.Event()
        self._held: set[tuple[str, str]] = set()
        self._threads: list[threading.Thread] = []
        self.started_at: dict[tuple[str, str, str], float] = {}  # (ns, name, uid) -> when marked Running

    # -- controls ---------------------------------------------------------------------------
    def hold(self, ns: str, name: str) -> None:
        self._held.add((ns, name))

    def release(self, ns: str, name: str) -> None:
        self._held.discard((ns, name))

    def fail(self, ns: str, name: str) -> None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pod = self.core.read_namespaced_pod(name, ns)
        cs = [{"name": c.name, "ready": False, "restartCount": 0, "image": c.image, "imageID": "docker://test",
               "state": {"terminated": {"exitCode": 1, "reason": "Error", "finishedAt": now}}}
              for c in pod.spec.containers]
        self.core.patch_namespaced_pod_status(name, ns, {"status": {
            "phase": "Failed", "containerStatuses": cs,
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": now}]}})

    def bump_restart(self, ns: str, name: str) -> None:
        for _ in range(20):  # optimistic concurrency: never overwrite a newer status, never lose the bump
            pod = self.core.read_namespaced_pod(name, ns)
            n = max([c.restart_count or 0 for c in (pod.status.container_statuses or [])] or [0])
            try:
                self.core.patch_namespaced_pod_status(name, ns, _pinned(_running_status(pod, restarts=n + 1), pod))
                return
            except ApiException as e:
                if e.status != 409:
                    raise
        raise AssertionError(f"could not bump the restart count of {ns}/{name}: 20 conflicts")

    # -- loop -------------------------------------------------------------------------------
    def start(self) -> "Kubelet":
        for target in (self._watch_loop, self._sweep_loop):
            t = threading.Thread(target=target, daemon=True, name=f"kubelet-{target.__name__}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()

    def _handle(self, pod) -> None:
        meta, spec, st = pod.metadata, pod.spec, pod.status
        key = (meta.namespace, meta.name)
        try:
            if meta.deletion_timestamp:
                self.core.delete_namespaced_pod(meta.name, meta.namespace, grace_period_seconds=0,
                                                body=client.V1DeleteOptions(grace_period_seconds=0,
                                                                            preconditions={"uid": meta.uid}),
                                                _request_timeout=CALL_TIMEOUT_S)
            elif spec.node_name and (st.phase or "Pending") == "Pending" and key not in self._held:
                # pinned to the resourceVersion we saw: a stale snapshot (the sweep's list) must not
                # overwrite a newer status, e.g. a restart count bumped by a test (a 409 is ignored)
                self.core.patch_namespaced_pod_status(meta.name, meta.namespace, _pinned(_running_status(pod), pod),
                                                      _request_timeout=CALL_TIMEOUT_S)
                self.started_at[(meta.namespace, meta.name, meta.uid)] = time.time()
        except ApiException as e:
            if e.status not in (404, 409):
                raise

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                w = watch.Watch()
                for ev in w.stream(self.core.list_pod_for_all_namespaces, timeout_seconds=WATCH_S,
                                   _request_timeout=WATCH_S + CALL_TIMEOUT_S):
                    if self._stop.is_set():
                        w.stop()
                        return
                    self._handle(ev["object"])
            except Exception:  # noqa: BLE001 — the API server may restart under us; keep going
                time.sleep(0.2)

    def _sweep_loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                for pod in self.core.list_pod_for_all_namespaces(_request_timeout=CALL_TIMEOUT_S).items:
                    self._handle(pod)
            except Exception:  # noqa: BLE001
                pass


class HealthServer:
    """Fake worker ``/healthz`` on 127.0.0.1: GET /healthz/<namespace>/<pod>."""

    def __init__(self):
        self.values: dict[tuple[str, str], int] = {}
        self.hits = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                parts = self.path.strip("/").split("/")
                outer.hits += 1
                if len(parts) != 3 or parts[0] != "healthz":
                    self.send_response(404)
                    self.end_headers()
                    return
                body = json.dumps({"prefetch_restarts": outer.values.get((parts[1], parts[2]), 0),
                                   "group_attempt": 0, "forwards": 0, "last_forward_age_s": None}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        self.url_template = f"http://127.0.0.1:{self.port}/healthz/{{namespace}}/{{pod}}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
