"""Idempotent writes of a ``Plan`` to the API server (the only module that changes the cluster).

Order (invariant 5 of ``desired``): status first (the intent: attempt numbers, phases), then
deletes, creates, patches, events; a plan with ``status_last`` (creates only) writes its status once
(``Plan.status_after_creates``), after the creates and patches, before the events. Every step is safe to
repeat: AlreadyExists on create and
NotFound on delete/patch are success (only a 409 whose Status reason is AlreadyExists: any other
409, a 429 or a 5xx fails the pass, which is retried, and nothing is remembered as created); a
failed status write aborts the plan (nothing else runs), so the next reconcile sees the old intent
and redoes the same steps.

Refusals: a create the API server refuses for a reason only a person can fix (``refusals.classify``:
kind not served, RBAC, quota, validation or webhook) does not fail the pass; it is recorded in the
status (``status.refusals`` and condition ChildrenAccepted, ``status.with_refusals``) and returned in
``ApplyResult.refusals`` for the reconciler to announce (Event, log line). Pods are created only when
every other child was accepted (a pod without its Secret, Services or ComputeDomain cannot run).

One writer of status: ``Applier._status`` is the only code that writes a DwdpGroup's status, at most
twice a pass (the intent before the deletes and creates, then, after the events, the refusals the
creates met) and once for a ``status_last`` plan (its status with the refusals folded in).

Whole gangs (``Plan.whole_gangs``, desired invariant 2a): their pods are created together, without
the scheduling gate; if any of them is refused or fails, the pods of that gang created in this call
are deleted again at once (grace 0: they never ran) and reported in ``ApplyResult.rolled_back``, so a
partial gang is never left schedulable. The refusal is then on record, and the next pass takes the
gated path.

Creates of long-lived children (Secret, Services, ComputeDomain) are remembered for ``REMEMBER_S``
seconds so a resync does not hammer the API with creates that answer 409; a child deleted by hand
comes back within that time. Pod creates are remembered per (name, attempt) for ``POD_REMEMBER_S``
(the pod informer lags our own writes by a few events): a pod recreated alone at the same attempt
(failurePolicy Degrade) within that time of its first creation is created once the memory ends (the pass
that skipped it waits for the pod, ``expectations``, at most as long, then runs again).
The memory is bounded: entries expire and are
dropped, and at most ``MEMORY_MAX`` are kept (invariant: it never grows with pods ever created).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

from .children import KINDS
from .desired import Plan
from .refusals import Refusal, classify, describe
from .rest import RawApi
from .spec import GROUP, KIND, PLURAL, VERSION
from .status import with_refusals

GROUP_VERSION = f"{GROUP}/{VERSION}"

log = logging.getLogger("dwdp_operator.apply")
REMEMBER_S = 30.0
POD_REMEMBER_S = 5.0
MEMORY_MAX = 100_000  # far above any live child count; a hard bound if the clock stalls


class ApiError(RuntimeError):
    """A transient API failure, described in one line (``refusals.describe``): retried."""


class ScaleRefused(RuntimeError):
    """The scale subresource write was refused (RBAC): only a person can fix it; the message says how."""


class CreateMemory:
    """Keys remembered until their own TTL passes; insertion-ordered, so expiry pops from the front, and a key
    asked about past its TTL is gone even when a longer-lived one in front of it kept it in the dict."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, max_entries: int = MEMORY_MAX):
        self.clock, self.max_entries = clock, max_entries
        self._until: OrderedDict[tuple, float] = OrderedDict()

    def remember(self, key: tuple, ttl: float) -> None:
        self._until.pop(key, None)
        self._until[key] = self.clock() + ttl
        self._expire()

    def __contains__(self, key: tuple) -> bool:
        self._expire()
        until = self._until.get(key)
        if until is not None and until <= self.clock():  # expired behind a longer-lived entry (see _expire)
            del self._until[key]
            return False
        return until is not None

    def forget(self, match: Callable[[tuple], bool]) -> None:
        for k in [k for k in self._until if match(k)]:
            del self._until[k]

    def __len__(self) -> int:
        return len(self._until)

    def _expire(self) -> None:
        now = self.clock()
        # TTLs differ per kind, so the front is not always the earliest: pop expired ones from the front,
        # and let the size bound catch any that hide behind a longer-lived entry
        while self._until and (next(iter(self._until.values())) <= now or len(self._until) > self.max_entries):
            self._until.popitem(last=False)


@dataclass
class ApplyResult:
    counts: dict[str, int] = field(default_factory=lambda: {"status": 0, "deleted": 0, "created": 0,
                                                            "patched": 0, "events": 0})
    refusals: list[Refusal] = field(default_factory=list)
    status: dict[str, Any] | None = None     # the status now on the object (as written, or as read)
    written: dict | None = None              # the DwdpGroup as the last status write returned it
    created_pods: list[str] = field(default_factory=list)   # pods that exist now (created, or already there)
    rolled_back: list[str] = field(default_factory=list)    # pods of a failed whole gang, deleted again
    error: Exception | None = None           # a create (the rest of the plan not applied) or the refusals' write failed


class Applier:
    def __init__(self, api: client.ApiClient | None = None, *, parallel: int = 8,
                 clock: Callable[[], float] = time.monotonic):
        self.api = RawApi(api or client.ApiClient())
        self.pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="dwdp-apply")
        self.known = CreateMemory(clock=clock)

    # -- reads -------------------------------------------------------------------------------
    def get_group(self, ns: str, name: str) -> dict | None:
        try:
            return self.api.get(GROUP_VERSION, ns, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise ApiError(f"GET DwdpGroup {ns}/{name}: {describe(e)}") from None

    # -- the plan ----------------------------------------------------------------------------
    def apply(self, cr: dict[str, Any], plan: Plan, *, now: float | None = None) -> ApplyResult:
        """Write ``plan`` (module docstring); ``now``: the wall clock of the refusals' condition."""
        meta = cr["metadata"]
        ns, name, uid = meta["namespace"], meta["name"], meta.get("uid", "")
        out = ApplyResult(status=cr.get("status") or {})
        last = plan.status_after_creates is not None
        if not last:
            self._status(out, ns, name, plan.status)
        out.counts["deleted"] = sum(self._map(lambda d: self._delete(ns, *d), plan.deletes))
        others = [m for m in plan.creates if m["kind"] != "Pod" and self._key(ns, m, uid) not in self.known]
        pods = [m for m in plan.creates if m["kind"] == "Pod"]
        out.created_pods = [m["metadata"]["name"] for m in pods if self._key(ns, m, uid) in self.known]
        pods = [m for m in pods if self._key(ns, m, uid) not in self.known]
        failed: Exception | None = None
        for batch in (others, pods):
            results = self._map(lambda m: _outcome(self._create, ns, m, uid), batch)
            out.counts["created"] += sum(1 for r in results if r is True)
            out.created_pods += [m["metadata"]["name"] for m, r in zip(batch, results)
                                 if m["kind"] == "Pod" and isinstance(r, bool)]
            out.refusals += _distinct(r for r in results if isinstance(r, Refusal))
            failed = failed or next((r for r in results if isinstance(r, Exception)), None)
            if batch is pods:
                self._roll_back_broken_gangs(out, ns, uid, plan, batch, results)
            if out.refusals or failed:
                break  # pods need every other child (invariant: refused prerequisites stop the pods)
        if failed is not None:
            out.error = failed  # the reconciler records what exists now (its expectations), then fails the pass
            return out
        out.counts["patched"] = sum(self._map(lambda p: self._patch_pod(ns, *p), plan.patches))
        refusals = [r.model_dump() for r in out.refusals]
        when = time.time() if now is None else now
        if last:  # with a refusal the creates did not all happen: the status before them
            status = plan.status if out.refusals else plan.status_after_creates
            self._status(out, ns, name, with_refusals(status, refusals, now=when) or status)
        for etype, reason, message in plan.events:
            out.counts["events"] += self.event(cr, etype, reason, message)
        if not last and plan.valid:  # an invalid plan creates nothing: the refusals on record stay as they are
            self._record_refusals(out, ns, name, refusals, now=when)
        return out

    def _record_refusals(self, out: ApplyResult, ns: str, name: str, refusals: list[dict], *, now: float) -> None:
        """The refusals the creates met, after the status written first: a failed write is the pass's
        ``error`` (retried), so the reconciler still records the pods this pass created."""
        recorded = with_refusals(out.status or {}, refusals, now=now)
        if recorded is None:
            return
        try:
            self._status(out, ns, name, recorded)
        except ApiError as e:
            out.error = e

    def _status(self, out: ApplyResult, ns: str, name: str, status: dict[str, Any]) -> None:
        """The one writer of status (module docstring): merge-patched when it changes anything."""
        if _changed(out.status or {}, status):
            out.written = self._patch_status(ns, name, status)
            out.counts["status"] += 1
        out.status = {**(out.status or {}), **status}

    def _roll_back_broken_gangs(self, out: ApplyResult, ns: str, uid: str, plan: Plan, batch: list[dict],
                                results: list) -> None:
        """Desired invariant 2a: a whole gang with any create refused or failed loses the pods it got."""
        outcome = {m["metadata"]["name"]: r for m, r in zip(batch, results)}
        for gang in plan.whole_gangs:
            tried = [n for n in gang if n in outcome]  # the others were created by an earlier pass
            if not any(isinstance(outcome[n], (Refusal, Exception)) for n in tried):
                continue  # every pod of it is there
            created = [n for n in tried if outcome[n] is True]
            for n in created:
                try:
                    KINDS["Pod"].delete(self.api, ns, n, grace_seconds=0)  # it never ran: no grace needed
                except ApiException as e:
                    if e.status != 404:  # left behind: the next pass restarts the group (invariant 2a)
                        log.warning("roll back Pod %s/%s: %s", ns, n, describe(e))
                        continue
                self.known.forget(lambda k, n=n: k[:3] == ("Pod", ns, n))
                out.rolled_back.append(n)
            out.created_pods = [n for n in out.created_pods if n not in gang]
            out.counts["created"] -= len(created)
            out.counts["deleted"] += len(created)

    def scale(self, ns: str, name: str, groups: int) -> None:
        """numGroups through the scale subresource (what ``kubectl scale`` and an HPA write): the autoscaler's
        only write to the spec. A refusal raises ``ScaleRefused`` with the fix, a transient error ``ApiError``."""
        try:
            self.api.merge_patch(GROUP_VERSION, ns, PLURAL, name, {"spec": {"replicas": groups}}, subresource="scale")
        except ApiException as e:
            if e.status == 403:
                raise ScaleRefused(f"the API server refused to scale DwdpGroup {ns}/{name} ({describe(e)}): grant the "
                                   f"operator patch on dwdpgroups/scale (Helm: --set groupAutoscaling.enabled=true)") from None
            raise ApiError(f"scale DwdpGroup {ns}/{name}: {describe(e)}") from None

    def _patch_status(self, ns: str, name: str, status: dict[str, Any]) -> dict | None:
        """Merge-patch the status; the DwdpGroup as the server returned it (the reconciler's newest copy)."""
        try:
            return self.api.merge_patch(GROUP_VERSION, ns, PLURAL, name, {"status": status}, subresource="status",
                                        want_body=True)
        except ApiException as e:
            raise ApiError(f"status of DwdpGroup {ns}/{name}: {describe(e)}") from None

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

    def _create(self, ns: str, m: dict, uid: str) -> bool | Refusal:
        """True = created, False = already there, a Refusal = refused; transient errors raise."""
        child, name = KINDS[m["kind"]], m["metadata"]["name"]
        try:
            child.create(self.api, ns, m)
            created = True
        except ApiException as e:
            if not _already_exists(e):
                refusal = classify(e, child, ns=ns, name=name)
                if refusal is not None:
                    return refusal
                raise ApiError(f"create {child.kind} {ns}/{name}: {describe(e)}") from None
            created = False
        self.known.remember(self._key(ns, m, uid), POD_REMEMBER_S if m["kind"] == "Pod" else REMEMBER_S)
        return created

    def _delete(self, ns: str, kind: str, name: str) -> int:
        try:
            KINDS[kind].delete(self.api, ns, name)
            if kind != "Pod":
                self.known.forget(lambda k: k[:3] == (kind, ns, name))
            return 1
        except ApiException as e:
            if e.status != 404:
                raise ApiError(f"delete {kind} {ns}/{name}: {describe(e)}") from None
            return 0

    def _patch_pod(self, ns: str, name: str, patch: dict) -> int:
        try:
            self.api.merge_patch("v1", ns, "pods", name, patch)
            return 1
        except ApiException as e:
            if e.status != 404:
                raise ApiError(f"patch Pod {ns}/{name}: {describe(e)}") from None
            return 0

    def event(self, cr: dict, etype: str, reason: str, message: str) -> int:
        meta = cr["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {"apiVersion": GROUP_VERSION, "kind": KIND, "name": meta["name"],
                               "namespace": meta["namespace"], "uid": meta.get("uid", "")},
            "type": etype, "reason": reason, "message": message[:1000],
            "source": {"component": "dwdp-operator"}, "firstTimestamp": now, "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.api.create("v1", meta["namespace"], "events", body)
            return 1
        except ApiException as e:  # an Event is best effort: never fail a reconcile for it
            log.warning("event %s/%s not posted: %s", meta["name"], reason, describe(e))
            return 0


def _outcome(fn, *args):
    """``fn(*args)``, or the exception it raised (one failed create must not hide the others' outcomes)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 — re-raised by apply after the gang roll-back
        return e


def _distinct(refusals) -> list[Refusal]:
    seen: dict[str, Refusal] = {}
    for r in refusals:
        seen.setdefault(r.reason, r)
    return list(seen.values())


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
