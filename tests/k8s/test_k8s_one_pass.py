"""One reconcile pass of the real reconciler (its real Applier) against the real API server, counted:
``desired_state`` runs once per pass, and every status write goes through ``Applier._status`` — one
write for a pass that creates a group, with or without a refused child (the refusal is folded into
that write). The reconciler runs in this process, one pass at a time, on a namespace the operator
subprocess does not watch (it watches ``dwdp-t-*``)."""

from __future__ import annotations

import asyncio
import inspect
import uuid

import pytest

from dwdp_operator import reconciler as R
from dwdp_operator.apply import Applier
from dwdp_operator.health import HealthReader
from dwdp_operator.observed import slim_pod
from dwdp_operator.rest import RawApi

from .conftest import group_body, release_namespace, wait_for


@pytest.fixture
def own_ns(cluster):
    name = f"dwdp-u-{uuid.uuid4().hex[:6]}"  # outside the operator's --namespace dwdp-t-*
    cluster.core.create_namespace({"metadata": {"name": name}})
    yield name
    release_namespace(cluster, name)


class Counted:
    """Spies on the real functions: ``desired_state`` calls, and status patches with the function that
    made each one (the frame below RawApi.merge_patch)."""

    def __init__(self, monkeypatch):
        self.desired, self.status_writers = 0, []
        real_desired, real_patch = R.desired_state, RawApi.merge_patch

        def desired_state(*args, **kwargs):
            self.desired += 1
            return real_desired(*args, **kwargs)

        def merge_patch(api, *args, **kwargs):
            if kwargs.get("subresource") == "status":
                caller = inspect.stack()[1]
                self.status_writers.append(f"{caller.frame.f_locals.get('self').__class__.__name__}.{caller.function}")
            return real_patch(api, *args, **kwargs)

        monkeypatch.setattr(R, "desired_state", desired_state)
        monkeypatch.setattr(RawApi, "merge_patch", merge_patch)


def _one_pass(c, ns: str, name: str) -> None:
    def pods_of(key):  # what the pod informer holds: slim pods of the group
        listed = c.core.list_namespaced_pod(ns, label_selector=f"dwdp.io/name={name}").items
        return [slim_pod(c.api.sanitize_for_serialization(p)) for p in listed]

    async def run():
        rec = R.Reconciler(applier=Applier(c.api), health=HealthReader(), pods_of=pods_of)
        try:
            return await rec._once((ns, name))
        finally:
            rec.close()
    asyncio.run(run())


def test_a_creating_pass_plans_once_and_writes_status_once(cluster, own_ns, monkeypatch):
    c = cluster
    c.create_group(own_ns, group_body("once", numGroups=1))
    counted = Counted(monkeypatch)
    _one_pass(c, own_ns, "once")
    assert counted.desired == 1
    assert counted.status_writers == ["Applier._patch_status"]
    status = c.get_group(own_ns, "once")["status"]
    # the one write is the status after the creates: the gang is complete, its 4 pods counted
    assert [(g["pods"], g["gangComplete"]) for g in status["groups"]] == [(4, True)]
    assert len(c.live_pods(own_ns)) == 4


def test_a_refused_pass_folds_the_refusal_into_its_one_status_write(cluster, own_ns, monkeypatch):
    c = cluster
    c.core.create_namespaced_resource_quota(own_ns, {"metadata": {"name": "no-pods"}, "spec": {"hard": {"pods": "0"}}})
    wait_for(lambda: c.core.read_namespaced_resource_quota("no-pods", own_ns).status.hard, timeout=30,
             what="quota controller synced")
    c.create_group(own_ns, group_body("refused", numGroups=1))
    counted = Counted(monkeypatch)
    _one_pass(c, own_ns, "refused")
    assert counted.desired == 1
    assert counted.status_writers == ["Applier._patch_status"]  # was two: the plan's, then the refusals'
    status = c.get_group(own_ns, "refused")["status"]
    assert [r["reason"] for r in status["refusals"]] == ["PodQuotaExceeded"]
    accepted = next(x for x in status["conditions"] if x["type"] == "ChildrenAccepted")
    assert (accepted["status"], accepted["reason"], status["state"]) == ("False", "PodQuotaExceeded", "Blocked")
    assert not c.live_pods(own_ns)
    assert [e for e in c.events(own_ns, "PodQuotaExceeded") if e.type == "Warning"]
