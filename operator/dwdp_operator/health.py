"""Read ``prefetch_restarts`` from each worker pod's ``GET /healthz`` (best effort).

Invariants:
  1. ``read_all`` never raises: an unreachable, slow or malformed pod is simply absent from the
     result (the status keeps its last known value), so health reads can never break a reconcile.
  2. The URL comes from ``health_url``: ``http://{ip}:{port}/healthz`` by default;
     ``DWDP_OPERATOR_HEALTH_HOST_OVERRIDE`` replaces the host, and ``DWDP_OPERATOR_HEALTH_URL``
     replaces the whole template (fields ``{ip} {port} {pod} {namespace}``), so tests can serve a
     fake ``/healthz`` on 127.0.0.1 and never touch pod networks.
  3. A pod is read at most once per ``min_interval`` seconds.
  4. The cache holds only live pods: it is kept per DwdpGroup, each read keeps just the pods passed
     in, and ``forget(key)`` drops a deleted DwdpGroup, so its size never grows with the pods ever
     seen (pod uids change on every group restart).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Hashable

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


@dataclass
class _Seen:
    value: int | None = None
    read_at: float = -1e18


class HealthReader:
    """Per DwdpGroup: pod uid -> prefetch_restarts, refreshed at most every ``min_interval`` seconds."""

    def __init__(self, *, min_interval: float = 10.0, parallel: int = 8):
        self.min_interval = min_interval
        self._groups: dict[Hashable, dict[str, _Seen]] = {}
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="dwdp-health")

    def read_all(self, key: Hashable, pods: list[dict], *, port: int, namespace: str) -> dict[str, int]:
        now = time.monotonic()
        old = self._groups.get(key, {})
        seen = {p["uid"]: old.get(p["uid"]) or _Seen() for p in pods}  # invariant 4: live pods only
        due = [p for p in pods if p.get("ip") and p.get("phase") == "Running" and not p.get("deleting")
               and now - seen[p["uid"]].read_at >= self.min_interval]
        for p in due:
            seen[p["uid"]].read_at = now
        urls = [health_url(ip=p["ip"], port=port, pod=p["name"], namespace=namespace) for p in due]
        try:
            results = list(self._pool.map(read_one, urls))
        except Exception:  # noqa: BLE001
            results = [None] * len(urls)
        for p, v in zip(due, results):
            if v is not None:
                seen[p["uid"]].value = v
        if seen:
            self._groups[key] = seen
        else:
            self._groups.pop(key, None)
        return {uid: s.value for uid, s in seen.items() if s.value is not None}

    def forget(self, key: Hashable) -> None:
        self._groups.pop(key, None)

    def __len__(self) -> int:
        """Pods cached, over every DwdpGroup."""
        return sum(len(g) for g in self._groups.values())
