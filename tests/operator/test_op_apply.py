"""apply.py and refusals.py without a server: what an API answer means (created, already there,
refused with a reason naming the kind and the fix, transient) and the bounded create memory."""

import json

import pytest
from kubernetes.client.rest import ApiException

from dwdp_operator.apply import CreateMemory, _already_exists
from dwdp_operator.children import KINDS, NO_DRA_DRIVER_FIX
from dwdp_operator.refusals import classify, describe


def _exc(status, reason=None, message="", details=None, raw=None):
    e = ApiException(status=status, reason={404: "Not Found", 403: "Forbidden"}.get(status, "x"))
    e.body = raw if raw is not None else (json.dumps({"kind": "Status", "code": status, "reason": reason,
                                                     "message": message, "details": details or {}})
                                          if reason else None)
    e.headers = {"Audit-Id": "a-long-header-dump"}
    return e


def test_only_already_exists_counts_as_there():
    assert _already_exists(_exc(409, "AlreadyExists"))
    assert not _already_exists(_exc(409, "Conflict")) and not _already_exists(_exc(409))


def test_kind_not_served_names_the_kind_and_the_fix():
    r = classify(_exc(404, raw="404 page not found"), KINDS["ComputeDomain"], ns="demo", name="r1-imex")
    assert r.reason == "ComputeDomainNotServed" and NO_DRA_DRIVER_FIX in r.message
    assert "resource.nvidia.com/v1beta1 ComputeDomain" in r.message and "demo/r1-imex" in r.message


def test_forbidden_quota_and_webhook_are_distinct_causes():
    pod = KINDS["Pod"]
    forbidden = classify(_exc(403, "Forbidden", 'pods is forbidden: User "x" cannot create'), pod, ns="n", name="p")
    quota = classify(_exc(403, "Forbidden", "pods \"p\" is forbidden: exceeded quota: gpus, requested: "
                                            "requests.nvidia.com/gpu=4"), pod, ns="n", name="p")
    hook = classify(_exc(403, "Forbidden", 'admission webhook "deny.example.com" denied the request'), pod,
                    ns="n", name="p")
    invalid = classify(_exc(422, "Invalid", "Pod \"p\" is invalid: spec.containers[0].image: Required"), pod,
                       ns="n", name="p")
    assert [r.reason for r in (forbidden, quota, hook, invalid)] == \
        ["PodForbidden", "PodQuotaExceeded", "PodRejected", "PodRejected"]
    assert "ResourceQuota of namespace n" in quota.message and "exceeded quota: gpus" in quota.message
    assert "create on pods in namespace n" in forbidden.message


def test_service_ip_range_full_is_a_refusal():
    e = _exc(500, "InternalError", "Internal error occurred: failed to allocate a serviceIP: range is full")
    r = classify(e, KINDS["Service"], ns="n", name="s")
    assert r.reason == "ServiceExhausted" and "--service-cluster-ip-range" in r.message


@pytest.mark.parametrize("exc", [_exc(409, "Conflict"), _exc(500, "InternalError"), _exc(429, "TooManyRequests"),
                                 _exc(404, "NotFound", "namespaces \"n\" not found", {"kind": "namespaces"})])
def test_transient_answers_are_not_refusals(exc):
    assert classify(exc, KINDS["Pod"], ns="n", name="p") is None


def test_describe_is_one_line_without_headers():
    line = describe(_exc(404, raw="404 page not found\n"))
    assert line == "404 Not Found: 404 page not found"
    assert "Audit-Id" not in describe(_exc(500, "InternalError", "etcd\nleader changed"))


def test_create_memory_is_bounded_under_10000_pod_uids_churned():
    now = [0.0]
    mem = CreateMemory(clock=lambda: now[0])
    peak = 0
    for i in range(10_000):
        now[0] += 0.01  # 100 creates/s
        mem.remember(("Pod", "ns", f"p{i % 50}", f"uid-{i}/0"), 5.0)
        peak = max(peak, len(mem))
    assert peak <= 501  # what 5 s of creates can hold, not what was ever created
    assert ("Pod", "ns", "p49", "uid-9999/0") in mem and ("Pod", "ns", "p0", "uid-0/0") not in mem


def test_create_memory_forgets_a_pod_at_its_own_ttl_behind_a_longer_lived_child():
    """A new DwdpGroup's pods are remembered (5 s) right after its Services (30 s): a pod entry must still end at
    its own TTL. It used to live as long as the entry in front of it, so a pod lost within 30 s of its group's
    creation was not recreated alone (failurePolicy Degrade) until then (tests/k8s/test_k8s_degrade.py found it)."""
    now = [0.0]
    mem = CreateMemory(clock=lambda: now[0])
    service, pod = ("Service", "ns", "r1", "uid"), ("Pod", "ns", "r1-g0-p2", "uid/0")
    mem.remember(service, 30.0)
    mem.remember(pod, 5.0)
    now[0] = 4.9
    assert pod in mem and service in mem
    now[0] = 5.0
    assert pod not in mem and service in mem
    assert len(mem) == 1


def test_create_memory_hard_bound():
    mem = CreateMemory(clock=lambda: 0.0, max_entries=100)
    for i in range(1000):
        mem.remember(("Pod", "ns", str(i), ""), 60.0)
    assert len(mem) == 100
