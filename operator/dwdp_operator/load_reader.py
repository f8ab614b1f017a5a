"""Read ``GET /v1/load`` of worker pods (best effort, short timeouts, in parallel): the autoscaler's input,
and whether a draining group still holds prefill work.

Invariants:
  1. ``read`` never raises: an unreachable, slow, malformed or other-version pod is simply absent from the
     answer (``parse_report`` refuses what it cannot read), so a load read never breaks a reconcile.
  2. Each read is bounded by ``TIMEOUT_S``; all pods are read at once on ``PARALLEL`` threads, so a pass
     waits at most about one timeout, whatever the number of pods.
  3. The URL: ``http://{ip}:{port}/v1/load`` by default; ``DWDP_OPERATOR_HEALTH_HOST_OVERRIDE`` replaces the
     host (as for ``/healthz``) and ``DWDP_OPERATOR_LOAD_URL`` the whole template (fields ``{ip} {port} {pod}
     {namespace}``), so tests can put a real worker behind a test pod's address.
  4. No Prometheus in between: the numbers are the worker's own, read directly (docs/OPERATOR.md says why).
"""

from __future__ import annotations

import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from dwdp_runtime.load.schema import LoadReport, parse_report

TIMEOUT_S = 0.5      # a front answers /v1/load from memory in milliseconds; a slow one is a missing signal
PARALLEL = 16        # pods read at once
MAX_BYTES = 1 << 16  # a report is ~2 KB; more is not a report


def load_url(*, ip: str, port: int, pod: str, namespace: str) -> str:
    template = os.environ.get("DWDP_OPERATOR_LOAD_URL") or "http://{ip}:{port}/v1/load"
    host = os.environ.get("DWDP_OPERATOR_HEALTH_HOST_OVERRIDE") or ip
    return template.format(ip=host, port=port, pod=pod, namespace=namespace)


def read_one(url: str, *, timeout: float = TIMEOUT_S) -> LoadReport | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (http only, by construction)
            return parse_report(json.loads(r.read(MAX_BYTES)))
    except Exception:  # noqa: BLE001 — invariant 1: any failure is "no signal"
        return None


class LoadReader:
    def __init__(self, *, parallel: int = PARALLEL):
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="dwdp-load")

    def read(self, pods: list[dict], *, port: int, namespace: str) -> dict[str, LoadReport]:
        """pod uid -> its report, for the Running pods with an IP that answered."""
        due = [p for p in pods if p.get("ip") and p.get("phase") == "Running" and not p.get("deleting")]
        urls = [load_url(ip=p["ip"], port=port, pod=p["name"], namespace=namespace) for p in due]
        try:
            results = list(self._pool.map(read_one, urls))
        except Exception:  # noqa: BLE001
            return {}
        return {p["uid"]: r for p, r in zip(due, results) if r is not None}
