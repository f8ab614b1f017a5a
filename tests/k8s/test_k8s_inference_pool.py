"""``spec.inferencePool`` on the test control plane (a minimal InferencePool CRD with v1's shape, like
the ComputeDomain one): the real operator creates an InferencePool that selects exactly the group's
serving pods on their HTTP port, asking for it never restarts a group, and removing it from the spec
deletes it."""

from __future__ import annotations

from .conftest import ROOT, group_body, wait_for

IP = ("inference.networking.k8s.io", "v1", "inferencepools")
CRD = ROOT / "tests/k8s/crds/inferencepool.yaml"


def _pool(c, ns, name):
    try:
        return c.custom.get_namespaced_custom_object(*IP[:2], ns, IP[2], name)
    except Exception:  # noqa: BLE001 - 404 until the operator created it
        return None


def test_inference_pool_follows_the_spec_and_selects_the_serving_pods(cluster, ns):
    c = cluster
    out = c.kubectl("apply", "-f", str(CRD), check=False)
    assert out.returncode == 0, out.stderr
    wait_for(lambda: c.kubectl("get", "inferencepools", "-A", check=False).returncode == 0, timeout=30,
             what="InferencePool CRD served")
    c.create_group(ns, group_body("ip", numGroups=1, httpPort=8100))
    wait_for(lambda: (c.get_group(ns, "ip").get("status") or {}).get("readyGroups") == 1, timeout=60,
             what="group ready")
    assert _pool(c, ns, "ip") is None and "inferencePool" not in c.get_group(ns, "ip")["status"]

    c.patch_spec(ns, "ip", {"inferencePool": {"endpointPicker": {"name": "ip-epp", "port": 9003}}})
    pool = wait_for(lambda: _pool(c, ns, "ip"), timeout=30, what="InferencePool created")
    assert pool["spec"]["targetPorts"] == [{"number": 8100}]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "ip-epp", "port": {"number": 9003},
                                                 "failureMode": "FailClose"}
    owner = pool["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "DwdpGroup" and owner["name"] == "ip" and owner["controller"] is True
    sel = ",".join(f"{k}={v}" for k, v in pool["spec"]["selector"]["matchLabels"].items())
    selected = sorted(p.metadata.name for p in c.live_pods(ns, sel))
    assert selected == sorted(p.metadata.name for p in c.live_pods(ns, "dwdp.io/name=ip")) and len(selected) == 4
    assert all(p.metadata.labels["llm-d.ai/role"] == "prefill" for p in c.live_pods(ns, sel))
    st = wait_for(lambda: (s := c.get_group(ns, "ip")["status"]).get("inferencePool") == "ip" and s, timeout=30,
                  what="status.inferencePool")
    assert [g["attempt"] for g in st["groups"]] == [0] and st["readyGroups"] == 1  # no restart for a pool

    c.patch_spec(ns, "ip", {"inferencePool": None})
    wait_for(lambda: _pool(c, ns, "ip") is None or None, timeout=30, what="InferencePool deleted")
    wait_for(lambda: "inferencePool" not in c.get_group(ns, "ip")["status"], timeout=30, what="status cleared")
    assert [g["attempt"] for g in c.get_group(ns, "ip")["status"]["groups"]] == [0]


def test_chart_grants_inference_pools_only_when_asked(cluster):
    import yaml

    chart = str(ROOT / "charts/dwdp-operator")

    def rules(*args):
        docs = yaml.safe_load_all(cluster.helm("template", "rel", chart, *args).stdout)
        role = next(d for d in docs if d and d["kind"] == "ClusterRole")
        return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]}

    pool_rules = {("inference.networking.k8s.io", "inferencepools", v) for v in ("create", "delete")}
    assert not rules() & pool_rules
    assert rules("--set", "gatewayInferenceExtension.enabled=true") >= pool_rules
