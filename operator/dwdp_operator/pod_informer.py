"""The operator's view of its worker pods: one list+watch per watched namespace (or one cluster-wide),
kept as (namespace, DwdpGroup name) -> pod name -> ``observed.slim_pod``.

Why not kopf's ``index`` + ``on.event("pods")``: kopf runs its per-object machinery (a worker task,
toggles, conditions) for every pod event, and its CPU per pod grew with the number of objects
(bench/operator_scale.py: 9 ms per pod at 50 DwdpGroups, 55 ms at 500). A plain informer costs one
JSON decode and one ``slim_pod`` per event.

Invariants:
  1. ``pods_of(key)`` is ``None`` until the first list of every stream is in (a reconcile never sees
     a partial pod list: a missing pod of a complete gang would read as a failure).
  2. Each stream lists, then watches from the list's resourceVersion, so no change between the two
     is lost; a broken or expired (410) watch relists after ``RELIST_BACKOFF_S`` and replaces that
     stream's pods wholesale, so a deletion missed while disconnected cannot leave a stale pod.
  3. Every key whose pods changed is passed to ``on_change`` (called on the informer's thread; the
     caller hops to its event loop). The index is only touched under its lock.
  4. The raw answers are parsed as JSON (``_preload_content=False``), never into client models.
  5. No call waits forever: a list has ``rest.REQUEST_TIMEOUT``, a watch a read limit of its server-side
     timeout plus ``WATCH_GRACE_S`` (the server closes a healthy watch by then), so a half-open connection
     ends in a relist instead of a stream that silently never delivers another pod change.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Callable

from kubernetes import client

from . import labels as L
from .observed import slim_pod
from .refusals import describe
from .rest import CONNECT_TIMEOUT_S, REQUEST_TIMEOUT

log = logging.getLogger("dwdp_operator.pods")
Key = tuple[str, str]
SELECTOR = f"{L.MANAGED_BY}={L.MANAGER},{L.COMPONENT}={L.WORKER_COMPONENT}"
RELIST_BACKOFF_S = 1.0
WATCH_TIMEOUT_S = 300  # the server ends a watch after this; the informer re-watches from its last version
#: a watch's read limit past WATCH_TIMEOUT_S: the server's closing chunk may come a little late under load
WATCH_GRACE_S = 30


class PodInformer:
    def __init__(self, api: client.ApiClient, *, namespaces: list[str] | None,
                 match: Callable[[str], bool], on_change: Callable[[Key], None]):
        """``namespaces``: exact names to watch one by one, or None for one cluster-wide stream whose
        pods are kept when ``match(namespace)`` (kopf's namespace patterns)."""
        self.core = client.CoreV1Api(api)
        self.streams: list[str | None] = list(namespaces) if namespaces else [None]
        self.match, self.on_change = match, on_change
        self._lock = threading.Lock()
        self._pods: dict[str | None, dict[Key, dict[str, dict]]] = {}  # stream -> key -> pod name -> slim
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- reads (event loop) ------------------------------------------------------------------
    def pods_of(self, key: Key) -> list[dict] | None:
        with self._lock:
            if len(self._pods) < len(self.streams):
                return None  # invariant 1
            out: list[dict] = []
            for by_key in self._pods.values():
                out += [dict(p) for p in (by_key.get(key) or {}).values()]
            return out

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "PodInformer":
        for ns in self.streams:
            t = threading.Thread(target=self._run, args=(ns,), name=f"dwdp-pods-{ns or 'all'}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()

    # -- the streams (informer threads) ------------------------------------------------------
    def _run(self, ns: str | None) -> None:
        while not self._stop.is_set():
            try:
                version = self._relist(ns)
                self._watch(ns, version)
            except Exception as e:  # noqa: BLE001 — invariant 2: relist, never die
                if self._stop.is_set():
                    return
                log.warning("pod watch (%s) broke: %s; relisting", ns or "all namespaces", describe(e))
            self._stop.wait(RELIST_BACKOFF_S)

    def _call(self, ns: str | None, **kw):
        if ns is None:
            return self.core.list_pod_for_all_namespaces(label_selector=SELECTOR, _preload_content=False, **kw)
        return self.core.list_namespaced_pod(ns, label_selector=SELECTOR, _preload_content=False, **kw)

    def _relist(self, ns: str | None) -> str:
        body = json.loads(self._call(ns, _request_timeout=REQUEST_TIMEOUT).data)
        fresh: dict[Key, dict[str, dict]] = {}
        for item in body.get("items") or []:
            key = self._key(item)
            if key is not None:
                fresh.setdefault(key, {})[item["metadata"]["name"]] = slim_pod(item)
        with self._lock:
            old = self._pods.get(ns) or {}
            self._pods[ns] = fresh
        for key in set(old) | set(fresh):
            if old.get(key) != fresh.get(key):
                self.on_change(key)
        return (body.get("metadata") or {}).get("resourceVersion") or ""

    def _watch(self, ns: str | None, version: str) -> None:
        resp = self._call(ns, watch=True, resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                          allow_watch_bookmarks=True,
                          _request_timeout=(CONNECT_TIMEOUT_S, WATCH_TIMEOUT_S + WATCH_GRACE_S))
        try:
            buf = b""
            for chunk in resp.stream(65536):
                if self._stop.is_set():
                    return
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._apply(ns, json.loads(line))
        finally:
            resp.release_conn()

    def _apply(self, ns: str | None, event: dict) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":  # e.g. 410 Gone: the version expired; relist (invariant 2)
            raise RuntimeError(f"watch error: {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        if kind == "BOOKMARK":
            return
        key = self._key(obj)
        if key is None:
            return
        name = obj["metadata"]["name"]
        with self._lock:
            by_key = self._pods.setdefault(ns, {})
            if kind == "DELETED":
                (by_key.get(key) or {}).pop(name, None)
                if not by_key.get(key):
                    by_key.pop(key, None)
            else:
                by_key.setdefault(key, {})[name] = slim_pod(obj)
        self.on_change(key)

    def _key(self, obj: dict) -> Key | None:
        meta = obj.get("metadata") or {}
        ns, owner = meta.get("namespace"), (meta.get("labels") or {}).get(L.NAME)
        if not ns or not owner or not self.match(ns):
            return None
        return (ns, owner)
