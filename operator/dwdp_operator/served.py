"""Wait until the API server's discovery lists the DwdpGroup resource; ``cli`` does it before every kopf start.

Why: kopf finds the resources it serves by discovery (``/apis``, then ``/apis/<group>/<version>``) once when it
starts, and again only when a CRD object changes. A 404 there is, to kopf, "no such resource", not an error.
A kube-apiserver that has just restarted serves lists of custom resources before its discovery lists them again:
on the test control plane (``scripts/test-cluster restart-apiserver``, 2 cores) ``/apis/dwdp.io/v1alpha1``
answered 404 or 503 for 1 to more than 9 s after the server came back, while the list of DwdpGroups already
answered 200. A kopf restarted in that window (``cli`` restarts it 1 s after the 404 its watch gets from the
same restart) found no DwdpGroup resource and ran blind: alive, no error, no reconcile, until the next CRD
change, which may never come. Seen on CI as ``test_apiserver_restart_mid_reconcile`` never converging.

Invariant: kopf is started only after one discovery read (``/apis`` lists ``dwdp.io/v1alpha1``, and that lists
``dwdpgroups``: kopf's own two steps) succeeded; a read
that did not gets another after ``POLL_S``, with a progress line every ``PROGRESS_S``, for at most ``WAIT_S``
(then ``NotServed``, which ``cli`` treats like the transient API error it usually is). Discovery is readable by
every authenticated client (the ``system:discovery`` role), so this needs no RBAC rule.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .spec import GROUP, PLURAL, VERSION

#: between two discovery reads: the window measured above ends within seconds, and one read is one small GET
POLL_S = 0.5
#: a progress line this often while waiting, so that a missing CRD is visible in the operator's log at once
PROGRESS_S = 10.0
#: how long one wait lasts: below the chart's liveness budget (10 s delay + 3 × 20 s period), so that the
#: operator says why before the kubelet restarts it
WAIT_S = 60.0
#: one discovery read's limit: a server that is coming back may accept the connection and answer late
READ_TIMEOUT_S = 5.0
log = logging.getLogger("dwdp_operator.served")


class NotServed(Exception):
    """The API server's discovery did not list the resource within the wait."""

    status = 404  # what kopf saw: ``cli`` restarts kopf on it (a missing CRD repeats it until its budget ends)


@dataclass(frozen=True)
class Resource:
    """A resource as discovery names it."""

    group: str
    version: str
    plural: str

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}/{self.version}"


DWDPGROUPS = Resource(GROUP, VERSION, PLURAL)


@dataclass(frozen=True)
class Discovery:
    """One discovery read: whether the resource was listed, and what the server said instead."""

    listed: bool
    detail: str


def read_discovery(api_client, resource: Resource = DWDPGROUPS) -> Discovery:
    """Read ``/apis`` and ``/apis/<group>/<version>`` once (any failure is a ``Discovery`` saying it)."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:  # kopf's order: the group list, then the group version's resources
        groups = client.ApisApi(api_client).get_api_versions(_request_timeout=READ_TIMEOUT_S)
        versions = [v.version for g in groups.groups or [] if g.name == resource.group for v in g.versions or []]
        if resource.version not in versions:
            return Discovery(False, f"discovery lists {resource.group} versions {versions or 'none'}, "
                                    f"not {resource.version}")
        found = client.CustomObjectsApi(api_client).get_api_resources(resource.group, resource.version,
                                                                      _request_timeout=READ_TIMEOUT_S)
    except ApiException as e:
        return Discovery(False, f"discovery answered {e.status}")
    except Exception as e:  # noqa: BLE001 — a server still starting: refused connections, timeouts
        return Discovery(False, f"discovery failed: {type(e).__name__}")
    names = sorted(r.name for r in (found.resources if found else None) or [])
    if resource.plural in names:
        return Discovery(True, "listed")
    return Discovery(False, f"discovery of {resource.group}/{resource.version} lists {names or 'nothing'}, "
                            f"not {resource.plural}")


def wait_until_served(api_client, resource: Resource = DWDPGROUPS, *, wait_s: float = WAIT_S,
                      poll_s: float = POLL_S, progress_s: float = PROGRESS_S) -> float:
    """Block until discovery lists ``resource``; returns the seconds waited, or raises ``NotServed``."""
    t0 = time.monotonic()
    said = t0 - progress_s  # the first miss is said at once
    while True:
        seen = read_discovery(api_client, resource)
        now = time.monotonic()
        if seen.listed:
            if now - t0 >= poll_s:
                log.info("the API server lists %s after %.1fs", resource, now - t0)
            return now - t0
        if now - t0 >= wait_s:
            hint = (" (helm install installs it; or kubectl apply -f crds/dwdpgroup.yaml)"
                    if resource == DWDPGROUPS else "")
            raise NotServed(f"{resource} is not served: {seen.detail} after {wait_s:.0f}s; is its CRD "
                            f"installed?{hint}")
        if now - said >= progress_s:
            log.info("waiting for the API server to list %s before starting kopf (%s)", resource, seen.detail)
            said = now
        time.sleep(poll_s)
