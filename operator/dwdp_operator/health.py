"""Read ``prefetch_restarts`` from each worker pod's ``GET /healthz`` (best effort).

Invariants:
  1. ``read_all`` never raises: an unreachable, slow or malformed pod is simply absent from the
     result (the status keeps its last known value), so health reads can never break a reconcile.
  2. The URL comes from ``health_url``: ``http://{ip}:{port}/healthz`` by default;
     ``DWDP_OPERATOR_HEALTH_HOST_OVERRIDE`` replaces the host, and ``DWDP_OPERATOR_HEALTH_URL``
     replaces the whole template (fields ``{ip} {port} {pod} {namespace}``), so tests can serve a
     fake ``/healthz`` on 127.0.0.1 and never touch pod networks.
  3. A pod is read at most once per ``min_interval`` seconds.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

TIMEOUT_S = 1.0


def health_url(*, ip: str, port: int, pod: str, namespace: str) -> str:
    template = os.environ.get("DWDP_OPERATOR_HEALTH_URL") or "http://{ip}:{port}/healthz"
    host = os.environ.get("DWDP_OPERATOR_HEALTH_HOST_OVERRIDE") or ip
    return template.format(ip=host, port=port, pod=pod, namespace=namespace)


def read_one(url: str, *, timeout: float = TIMEOUT_S) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (http only, by construction)
            data = json.loads(r.read(65536))
        v = data.get("prefetch_restarts") if isinstance(data, dict) else None
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None
    except Exception:  # noqa: BLE001 — invariant 1: any failure is "unknown"
        return None


class HealthReader:
    """Cache of pod uid -> prefetch_restarts, refreshed at most every ``min_interval`` seconds."""

    def __init__(self, *, min_interval: float = 10.0, parallel: int = 8):
        self.min_interval = min_interval
        self.values: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="dwdp-health")

    def read_all(self, pods: list[dict], *, port: int, namespace: str) -> dict[str, int]:
        now = time.monotonic()
        due = [p for p in pods if p.get("ip") and p.get("phase") == "Running" and not p.get("deleting")
               and now - self._last.get(p["uid"], -1e9) >= self.min_interval]
        for p in due:
            self._last[p["uid"]] = now
        urls = [health_url(ip=p["ip"], port=port, pod=p["name"], namespace=namespace) for p in due]
        try:
            results = list(self._pool.map(read_one, urls))
        except Exception:  # noqa: BLE001
            results = [None] * len(urls)
        for p, v in zip(due, results):
            if v is not None:
                self.values[p["uid"]] = v
        live = {p["uid"] for p in pods}
        return {uid: v for uid, v in self.values.items() if uid in live}

    def forget(self, uids: set[str]) -> None:
        for uid in uids:
            self.values.pop(uid, None)
            self._last.pop(uid, None)
