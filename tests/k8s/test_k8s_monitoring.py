"""The chart's monitoring options: the operator's metrics Service, the Prometheus Operator's
ServiceMonitor (operator) and PodMonitor (workers), and the Grafana dashboard ConfigMap — rendered
with ``helm template`` and installed on the test control plane (minimal monitoring CRDs, like the
ComputeDomain one). Selectors are checked against what really carries the labels: the metrics
Service's Endpoints must list the operator pod, and the PodMonitor must select the worker pods the
real operator creates."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from .conftest import ROOT, group_body, wait_for

CHART = str(ROOT / "charts/dwdp-operator")
MONITORING_CRDS = ROOT / "tests/k8s/crds/monitoring.yaml"
ALL_ON = ("--set", "monitoring.serviceMonitor.enabled=true", "--set", "monitoring.podMonitor.enabled=true",
          "--set", "monitoring.dashboard.enabled=true")


def _docs(c, *args) -> list[dict]:
    return [d for d in yaml.safe_load_all(c.helm("template", "rel", CHART, *args).stdout) if d]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_monitoring_options_render(cluster):
    c = cluster
    default = {d["kind"] for d in _docs(c)}
    assert "Service" in default and not default & {"ServiceMonitor", "PodMonitor", "ConfigMap"}  # opt-in
    assert "Service" not in {d["kind"] for d in _docs(c, "--set", "metrics.enabled=false")}
    docs = _docs(c, *ALL_ON, "--set", "monitoring.serviceMonitor.labels.release=kps",
                 "--set", "watchNamespaces={team-a,team-b}", "--set", "monitoring.dashboard.namespace=grafana")
    by_kind = {d["kind"]: d for d in docs}
    svc, sm, pm, cm, dep = (by_kind[k] for k in ("Service", "ServiceMonitor", "PodMonitor", "ConfigMap", "Deployment"))
    assert _selects(svc["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert "metrics" in [p["name"] for p in container["ports"]] and svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert _selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    assert sm["metadata"]["labels"]["release"] == "kps" and sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "http"
    # the PodMonitor selects the worker pods the real operator renders (its own manifest code)
    import sys
    sys.path.insert(0, str(ROOT / "operator"))
    from dwdp_operator import manifests
    from dwdp_operator.spec import parse_spec

    spec, errors = parse_spec(group_body("x")["spec"])
    assert not errors, errors
    pod = manifests.worker_pod(name="x", ns="team-a", uid="u", g=0, i=0, attempt=0, spec=spec, thash="h")
    assert _selects(pm["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"])
    assert "http" in [p["name"] for p in pod["spec"]["containers"][0]["ports"]]
    assert set(pm["spec"]["podTargetLabels"]) <= set(pod["metadata"]["labels"])
    assert cm["metadata"]["namespace"] == "grafana" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["dwdp.json"]) == json.loads((Path(CHART) / "dashboards/dwdp.json").read_text())
    globbed = next(d for d in _docs(c, *ALL_ON, "--set", "watchNamespaces={team-*}") if d["kind"] == "PodMonitor")
    assert globbed["spec"]["namespaceSelector"] == {"any": True}
    bad = c.helm("template", "rel", CHART, "--set", "monitoring.serviceMonitor.enabled=true",
                 "--set", "metrics.enabled=false", check=False)
    assert bad.returncode != 0 and "metrics.enabled" in bad.stderr
    bad = c.helm("template", "rel", CHART, "--set", "monitoring.podMonitor.interval=soon", check=False)
    assert bad.returncode != 0 and "interval" in bad.stderr


def test_monitoring_installs_and_selects_real_objects(cluster):
    c = cluster
    c.kubectl("apply", "-f", str(MONITORING_CRDS))
    wait_for(lambda: c.kubectl("get", "podmonitors", "-A", check=False).returncode == 0, timeout=30,
             what="monitoring CRDs served")
    ns, rel = "dwdp-mon", "mon"
    out = c.helm("install", rel, CHART, "-n", ns, "--create-namespace", "--wait", "--timeout", "90s", *ALL_ON,
                 "--set", "watchNamespaces={dwdp-t-*}", check=False)
    assert out.returncode == 0, out.stderr
    try:
        sm = c.custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", ns, "servicemonitors",
                                                   "mon-dwdp-operator")
        pm = c.custom.get_namespaced_custom_object("monitoring.coreos.com", "v1", ns, "podmonitors",
                                                   "mon-dwdp-operator-workers")
        assert sm["spec"]["endpoints"][0]["port"] == "metrics" and pm["spec"]["namespaceSelector"] == {"any": True}
        cm = c.core.read_namespaced_config_map("mon-dwdp-operator-dashboard", ns)
        assert json.loads(cm.data["dwdp.json"])["uid"] == "dwdp-serving"
        # the metrics Service selects the running operator pod by its labels, on a port it declares
        # (Endpoints stay empty here: the test kubelet's pods have the loopback IP, which Endpoints refuse)
        svc = c.core.read_namespaced_service("mon-dwdp-operator-metrics", ns)
        sel = ",".join(f"{k}={v}" for k, v in svc.spec.selector.items())
        pods = [p for p in c.core.list_namespaced_pod(ns, label_selector=sel).items if p.status.phase == "Running"]
        assert len(pods) == 1 and pods[0].metadata.name.startswith("mon-dwdp-operator-")
        declared = {port.name: port.container_port for port in pods[0].spec.containers[0].ports}
        assert declared.get(svc.spec.ports[0].target_port) == 9090
    finally:
        c.helm("uninstall", rel, "-n", ns, check=False)
