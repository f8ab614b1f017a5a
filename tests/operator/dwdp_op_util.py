"""Builders of DwdpGroup objects and slim pods for the pure unit tests."""

from __future__ import annotations

import copy

from dwdp_operator import labels as L
from dwdp_operator import manifests as M
from dwdp_operator.observed import slim_pod

BASE_SPEC = {
    "numGroups": 2, "dwdpSize": 4, "gpusPerPod": 1, "image": "dwdp:test",
    "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4},
    "model": {"synthetic": "qwen3_moe"},
    "restartPolicy": {"maxRestarts": 2, "backoffSeconds": 10},
}


def spec(**over) -> dict:
    s = copy.deepcopy(BASE_SPEC)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(s.get(k), dict):
            s[k] = {**s[k], **v}
        else:
            s[k] = v
    return s


def cr(spec_: dict | None = None, status: dict | None = None, name: str = "r1") -> dict:
    return {"apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpGroup",
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": spec_ if spec_ is not None else spec(), "status": status or {}}


def pods_from(plan, *, phase="Running", ready=True, gang="complete") -> list[dict]:
    """Turn a plan's pod creates into observed slim pods (what a kubelet would report)."""
    out = []
    for m in plan.creates:
        if m["kind"] != "Pod":
            continue
        body = copy.deepcopy(m)
        body["metadata"]["uid"] = "u-" + body["metadata"]["name"] + "-" + body["metadata"]["labels"][L.ATTEMPT]
        body["metadata"]["labels"][L.GANG] = gang
        body["status"] = {"phase": phase, "podIP": "127.0.0.1",
                          "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                          "containerStatuses": [{"name": "worker", "restartCount": 0, "ready": ready}]}
        out.append(slim_pod(body))
    return out


def with_(pods: list[dict], name: str, **changes) -> list[dict]:
    out = []
    for p in pods:
        p = copy.deepcopy(p)
        if p["name"] == name:
            p.update(changes)
        out.append(p)
    return out


__all__ = ["BASE_SPEC", "spec", "cr", "pods_from", "with_", "M", "L"]
