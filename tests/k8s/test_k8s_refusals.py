"""Children the API server refuses are visible to a user (issue 19): the reason names the kind and
the fix in ``kubectl describe`` and ``kubectl get``, one Warning Event and one log line per distinct
cause however often the operator retries, no HTTP dump in the log, and everything clears once a
person fixes the cluster. Real API server, real operator; the HGX one-pod group on the real scheduler."""

from __future__ import annotations

import time

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.timing import hold
from .conftest import ROOT, group_body, wait_for

CD_CRD = "computedomains.resource.nvidia.com"
FIX = "install the NVIDIA DRA driver for GPUs (ComputeDomain CRD) or set imex.mode: None"


def _cd_served(c) -> bool:
    try:
        c.custom.list_cluster_custom_object("resource.nvidia.com", "v1beta1", "computedomains")
        return True
    except ApiException as e:
        if e.status == 404:
            return False
        raise


def _describe(c, ns, name) -> str:
    return c.kubectl("describe", "dwdp", name, "-n", ns).stdout


def _new_log(c, since: int) -> str:
    return c.operator.log()[since:]


def test_missing_computedomain_crd_is_named_with_the_fix_then_clears(cluster, ns):
    c = cluster
    ext = client.ApiextensionsV1Api(c.api)
    ext.delete_custom_resource_definition(CD_CRD)
    try:
        wait_for(lambda: not _cd_served(c), timeout=30, what="ComputeDomain no longer served")
        log_start = len(c.operator.log())
        c.create_group(ns, group_body("nocd", numGroups=1))
        t0 = time.time()
        wait_for(lambda: "ComputeDomainNotServed" in _describe(c, ns, "nocd"), timeout=10,
                 what="the reason in kubectl describe")
        shown = time.time() - t0
        text = _describe(c, ns, "nocd")
        assert FIX in " ".join(text.split()), text
        row = c.kubectl("get", "dwdp", "nocd", "-n", ns).stdout.split()
        assert row[-3:-1] == ["Blocked", "ComputeDomainNotServed"], row
        assert not c.live_pods(ns), "no pod without its ComputeDomain"
        hold(6, "several of the operator's retries: still one Event, one log line")
        warnings = [e for e in c.events(ns, "ComputeDomainNotServed") if e.type == "Warning"]
        assert len(warnings) == 1 and FIX in warnings[0].message
        log = _new_log(c, log_start)
        mine = [ln for ln in log.splitlines() if f"{ns}/nocd: ComputeDomain refused" in ln]
        assert len(mine) == 1, log[-3000:]  # (groups of other tests' namespaces may be refused too)
        assert "HTTPHeaderDict" not in log and "Traceback" not in log and "HTTP response" not in log, log[-3000:]
    finally:
        ext.create_custom_resource_definition(yaml.safe_load((ROOT / "tests/k8s/crds/computedomain.yaml").read_text()))
    wait_for(lambda: _cd_served(c), timeout=30, what="ComputeDomain served again")
    wait_for(lambda: (x := c.condition(ns, "nocd", "ChildrenAccepted")) and x["status"] == "True", timeout=40,
             what="ChildrenAccepted once the CRD is installed")
    assert c.custom.get_namespaced_custom_object("resource.nvidia.com", "v1beta1", ns, "computedomains", "nocd-imex")
    wait_for(lambda: len(c.live_pods(ns)) == 4, timeout=30, what="the group's pods")
    assert "ComputeDomainNotServed" not in c.kubectl("get", "dwdp", "nocd", "-n", ns).stdout
    print(f"reason shown after {shown:.1f}s")


def test_quota_refusal_is_a_condition_and_clears_when_raised(cluster, ns):
    c = cluster
    quota = {"metadata": {"name": "gpus"}, "spec": {"hard": {"requests.nvidia.com/gpu": "2"}}}
    c.core.create_namespaced_resource_quota(ns, quota)
    wait_for(lambda: c.core.read_namespaced_resource_quota("gpus", ns).status.hard, timeout=30,
             what="quota controller synced")
    c.create_group(ns, group_body("q", numGroups=1))
    wait_for(lambda: (x := c.condition(ns, "q", "ChildrenAccepted")) and x["reason"] == "PodQuotaExceeded",
             timeout=20, what="PodQuotaExceeded")
    cond = c.condition(ns, "q", "ChildrenAccepted")
    assert "ResourceQuota of namespace" in cond["message"] and "exceeded quota" in cond["message"]
    # what the quota admits: the whole-gang create was rolled back (no ungated partial gang), and the retry
    # took the gated path (gang label pending, the gate keeps them unscheduled on servers that honour it)
    wait_for(lambda: len(c.live_pods(ns)) == 2, timeout=20, what="two gated pods")
    assert {p.metadata.labels["dwdp.io/gang"] for p in c.live_pods(ns)} == {"pending"}
    c.core.delete_namespaced_resource_quota("gpus", ns)
    wait_for(lambda: c.condition(ns, "q", "ChildrenAccepted")["status"] == "True" and len(c.live_pods(ns)) == 4,
             timeout=40, what="pods once the quota is gone")
    assert len([e for e in c.events(ns, "PodQuotaExceeded") if e.type == "Warning"]) == 1


def test_hgx_group_is_one_pod_holding_every_gpu(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("hgx", numGroups=2, gpusPerPod=4, imex={"mode": "None"}))
    wait_for(lambda: (c.get_group(ns, "hgx").get("status") or {}).get("readyGroups") == 2, timeout=60,
             what="two one-pod groups ready")
    pods = c.live_pods(ns)
    assert sorted(p.metadata.name for p in pods) == ["hgx-g0-p0", "hgx-g1-p0"]
    for p in pods:
        ctr = p.spec.containers[0]
        env = {e.name: e.value for e in ctr.env}
        assert ctr.resources.limits["nvidia.com/gpu"] == "4" and env["DWDP_GPUS_PER_POD"] == "4"
        assert env["DWDP_RANK_BASE"] == "0" and "CUDA_VISIBLE_DEVICES" not in env
    try:
        c.custom.get_namespaced_custom_object("resource.nvidia.com", "v1beta1", ns, "computedomains", "hgx-imex")
        raise AssertionError("no ComputeDomain without IMEX")
    except ApiException as e:
        assert e.status == 404
    c.patch_spec(ns, "hgx", {"gpusPerPod": 1})  # split over 4 nodes without IMEX: refused with the fix
    wait_for(lambda: (x := c.condition(ns, "hgx", "Invalid")) and x["status"] == "True", timeout=15, what="Invalid")
    assert "one HGX node: gpusPerPod = dwdpSize" in c.condition(ns, "hgx", "Invalid")["message"]
