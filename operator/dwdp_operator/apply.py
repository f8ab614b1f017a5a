"""Idempotent writes of a ``Plan`` to the API server (the only module that changes the cluster).

Order (invariant 4 of ``desired``): status first (the intent: attempt numbers, phases), then
deletes, creates, patches, events. Every step is safe to repeat: AlreadyExists on create and
NotFound on delete/patch are success (only a 409 whose Status reason is AlreadyExists: any other
409, a 429 or a 5xx fails the pass, which is retried, and nothing is remembered as created); a failed status write aborts the plan (nothing else runs),
so the next reconcile sees the old intent and redoes the same steps.

Creates of long-lived children (Secret, Services, ComputeDomain) are remembered for
``REMEMBER_S`` seconds so a resync does not hammer the API with creates that answer 409;
a child deleted by hand comes back within that time. Pod creates are remembered per
(name, attempt) for ``POD_REMEMBER_S`` (the kopf index lags our own writes by a few events).
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from .desired import Plan
from .manifests import CD_API_VERSION
from .spec import GROUP, KIND, PLURAL, VERSION

log = logging.getLogger("dwdp_operator.apply")
REMEMBER_S = 30.0
POD_REMEMBER_S = 5.0


class Applier:
    def __init__(self, api: client.ApiClient | None = None, *, parallel: int = 8):
        self.api = api or client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.net = client.NetworkingV1Api(self.api)
        self.pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="dwdp-apply")
        self._known: dict[tuple[str, str, str, str], float] = {}

    # -- reads -------------------------------------------------------------------------------
    def get_group(self, ns: str, name: str) -> dict | None:
        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    # -- the plan ----------------------------------------------------------------------------
    def apply(self, cr: dict[str, Any], plan: Plan) -> dict[str, int]:
        meta = cr["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        counts = {"status": 0, "deleted": 0, "created": 0, "patched": 0, "events": 0}
        if _changed(cr.get("status") or {}, plan.status):
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, ns, PLURAL, name, {"status": plan.status})
            counts["status"] = 1
        counts["deleted"] = sum(self._map(lambda d: self._delete(ns, *d), plan.deletes))
        pods = [m for m in plan.creates if m["kind"] == "Pod" and not self._remembered(ns, m, uid)]
        others = [m for m in plan.creates if m["kind"] != "Pod" and not self._remembered(ns, m, uid)]
        counts["created"] = sum(self._map(lambda m: self._create(ns, m, uid), others))
        counts["created"] += sum(self._map(lambda m: self._create(ns, m, uid), pods))
        counts["patched"] = sum(self._map(lambda p: self._patch_pod(ns, *p), plan.patches))
        for etype, reason, message in plan.events:
            counts["events"] += self.event(cr, etype, reason, message)
        return counts

    def _map(self, fn, items) -> list:
        items = list(items)
        if len(items) <= 1:
            return [fn(i) for i in items]
        return list(self.pool.map(fn, items))

    @staticmethod
    def _key(ns: str, m: dict, uid: str) -> tuple[str, str, str, str]:
        # pods: remember (name, attempt): the kopf index may lag our own creates by a few events
        tag = uid if m["kind"] != "Pod" else f"{uid}/{m['metadata']['labels'].get('dwdp.io/attempt')}"
        return (m["kind"], ns, m["metadata"]["name"], tag)

    def _remembered(self, ns: str, m: dict, uid: str) -> bool:
        ttl = REMEMBER_S if m["kind"] != "Pod" else POD_REMEMBER_S
        return time.monotonic() - self._known.get(self._key(ns, m, uid), -1e9) < ttl

    def _create(self, ns: str, m: dict, uid: str) -> int:
        kind = m["kind"]
        try:
            if kind == "Pod":
                self.core.create_namespaced_pod(ns, m)
            elif kind == "Service":
                self.core.create_namespaced_service(ns, m)
            elif kind == "Secret":
                self.core.create_namespaced_secret(ns, m)
            elif kind == "NetworkPolicy":
                self.net.create_namespaced_network_policy(ns, m)
            elif kind == "ComputeDomain":
                g, v = CD_API_VERSION.split("/")
                self.custom.create_namespaced_custom_object(g, v, ns, "computedomains", m)
            else:
                raise ValueError(f"unknown kind {kind}")
            created = 1
        except ApiException as e:
            if not _already_exists(e):
                raise
            created = 0
        self._known[self._key(ns, m, uid)] = time.monotonic()
        return created

    def _delete(self, ns: str, kind: str, name: str) -> int:
        try:
            if kind == "Pod":
                # _preload_content=False: a 1.20 server answers some deletes with a Status that the
                # typed client cannot parse into the object type
                self.core.delete_namespaced_pod(name, ns, _preload_content=False)
            elif kind in ("Service", "NetworkPolicy"):
                if kind == "Service":
                    self.core.delete_namespaced_service(name, ns, _preload_content=False)
                else:
                    self.net.delete_namespaced_network_policy(name, ns, _preload_content=False)
                self._known = {k: v for k, v in self._known.items() if k[:3] != (kind, ns, name)}
            else:
                raise ValueError(f"unknown kind {kind}")
            return 1
        except ApiException as e:
            if e.status != 404:
                raise
            return 0

    def _patch_pod(self, ns: str, name: str, patch: dict) -> int:
        try:
            self.core.patch_namespaced_pod(name, ns, patch, _content_type="application/merge-patch+json")
            return 1
        except ApiException as e:
            if e.status != 404:
                raise
            return 0

    def event(self, cr: dict, etype: str, reason: str, message: str) -> int:
        meta = cr["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid", "")},
            "type": etype, "reason": reason, "message": message[:1000],
            "source": {"component": "dwdp-operator"}, "firstTimestamp": now, "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body)
            return 1
        except ApiException as e:  # an Event is best effort: never fail a reconcile for it
            log.warning("event %s/%s not posted: %s", meta["name"], reason, e.reason)
            return 0


def _already_exists(e: ApiException) -> bool:
    """A create's 409 means "exists" only with reason AlreadyExists; a bare 409 (Conflict) is a failure."""
    if e.status != 409:
        return False
    try:
        return (json.loads(e.body or "{}") or {}).get("reason") == "AlreadyExists"
    except (ValueError, TypeError, AttributeError):
        return False


def _changed(old: dict, new: dict) -> bool:
    return any(old.get(k) != v for k, v in new.items())
