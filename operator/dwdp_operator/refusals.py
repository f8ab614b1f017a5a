"""API answers as user-facing facts: a child the API server refuses becomes a ``Refusal`` (a
condition reason naming the kind, and the fix); any other API error becomes one concise line.

Invariants:
  1. Nothing here (or anywhere in the operator's logs) prints an ``ApiException`` itself: its
     ``str()`` carries the HTTP headers and body. ``describe`` gives ``<code> <reason>: <message>``.
  2. A refusal is something only a person can fix: the kind is not served (404 on the kind's
     path), forbidden by RBAC (403), over a ResourceQuota (403 naming a quota), rejected by
     validation / an admission webhook (400, 422, or 403 from a webhook), or a cluster pool is
     exhausted (the Service IP allocator's 500 "range is full"; found by bench/operator_scale.py). Everything else (409
     conflicts, 429, 5xx, a namespace being deleted) is transient: retried, never a condition.
  3. ``Refusal.reason`` is ``<Kind><Cause>`` (``ComputeDomainNotServed``, ``PodQuotaExceeded``): one
     distinct cause = one reason = one Warning event, however often the create is retried.
  4. Telling quota and webhook refusals from RBAC's 403 reads the API server's own message
     (Kubernetes gives them no separate reason code; kubectl does the same).
"""

from __future__ import annotations

import json
from enum import StrEnum

from kubernetes.client.rest import ApiException
from pydantic import BaseModel, ConfigDict, Field

from .children import ChildKind

SERVER_MESSAGE_CHARS = 300  # enough for a quota or webhook message; never a whole HTTP body


class Cause(StrEnum):
    NOT_SERVED = "NotServed"
    FORBIDDEN = "Forbidden"
    QUOTA_EXCEEDED = "QuotaExceeded"
    REJECTED = "Rejected"
    EXHAUSTED = "Exhausted"  # a cluster-wide pool ran out (the Service IP range: a 500 from the allocator)


class Refusal(BaseModel):
    """One distinct reason the API server refused a child (``status.refusals[]``)."""

    model_config = ConfigDict(frozen=True)
    kind: str = Field(description="kind of the refused child")
    # the condition reason and the Event reason
    reason: str = Field(description=f"<Kind><Cause>, the cause one of {', '.join(Cause)}")
    message: str = Field(description="what was refused, the API server's words and the fix")


def _status_body(e: ApiException) -> dict:
    try:
        body = json.loads(e.body or "")
    except (ValueError, TypeError):
        return {}
    return body if isinstance(body, dict) and body.get("kind") == "Status" else {}


def server_message(e: ApiException) -> str:
    status = _status_body(e)
    text = status.get("message") if status else (e.body.decode() if isinstance(e.body, bytes) else e.body)
    return " ".join(str(text or e.reason or "").split())[:SERVER_MESSAGE_CHARS]


def describe(e: BaseException) -> str:
    """One line for a log or a condition: ``404 Not Found: 404 page not found`` (invariant 1)."""
    if isinstance(e, ApiException):
        return f"{e.status} {e.reason}: {server_message(e)}"
    return f"{type(e).__name__}: {' '.join(str(e).split())[:SERVER_MESSAGE_CHARS]}"


def classify(e: ApiException, child: ChildKind, *, ns: str, name: str) -> Refusal | None:
    """The refusal a create's ``ApiException`` means, or ``None`` when it is transient (invariant 2)."""
    status, said = _status_body(e), server_message(e)
    what = f"{child.kind} {ns}/{name}"
    if e.status == 404:
        if (status.get("details") or {}).get("kind") == "namespaces":
            return None  # the namespace is going away with its DwdpGroup
        return _refusal(child, Cause.NOT_SERVED, f"{what}: the API server does not serve {child.api_version} "
                                                 f"{child.kind} ({said}); {child.fix_when_not_served()}")
    lowered = said.lower()
    if e.status in (400, 422) or (e.status == 403 and "admission webhook" in lowered):
        return _refusal(child, Cause.REJECTED, f"{what} rejected ({e.status}): {said}; fix the spec fields it "
                                               f"names or the admission policy that refuses it")
    if e.status == 500 and "range is full" in lowered:
        return _refusal(child, Cause.EXHAUSTED, f"{what}: {said}; the cluster's Service IP range is used up: "
                                                f"delete unused Services or widen the API server's "
                                                f"--service-cluster-ip-range")
    if e.status == 403 and "quota" in lowered:
        return _refusal(child, Cause.QUOTA_EXCEEDED, f"{what} over quota: {said}; raise the ResourceQuota of "
                                                     f"namespace {ns} or lower numGroups / gpusPerPod")
    if e.status == 403:
        return _refusal(child, Cause.FORBIDDEN, f"{what} forbidden: {said}; grant the operator's ServiceAccount "
                                                f"create on {child.plural} in namespace {ns} (the chart's RBAC "
                                                f"does: check rbac.create and watchNamespaces)")
    return None


def _refusal(child: ChildKind, cause: Cause, message: str) -> Refusal:
    return Refusal(kind=child.kind, reason=f"{child.kind}{cause}", message=message)
