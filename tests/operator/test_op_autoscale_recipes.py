"""The HPA and KEDA recipes (examples/autoscaling-*.yaml): they target the DwdpGroup's scale subresource and read
signals the worker serves, under the names and series labels the worker and the chart's PodMonitor give them."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from dwdp_runtime.load.schema import LoadMetric

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds/dwdpgroup.yaml").read_text())
NAMES = {str(m) for m in LoadMetric}


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def _targets_the_scale_subresource(obj: dict) -> None:
    ref = obj["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (f"{CRD['spec']['group']}/v1alpha1", CRD["spec"]["names"]["kind"])
    scale = CRD["spec"]["versions"][0]["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.numGroups" and scale["labelSelectorPath"] == ".status.selector"


def test_hpa_reads_the_saturation_of_every_worker_pod():
    hpa = _load("autoscaling-hpa.yaml")
    _targets_the_scale_subresource(hpa)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == LoadMetric.SATURATION
    assert 0 < float(metric["pods"]["target"]["averageValue"].rstrip("m")) / 1000 < 1


def test_keda_reads_the_offered_load_summed_per_dwdpgroup():
    keda = _load("autoscaling-keda.yaml")
    _targets_the_scale_subresource(keda)
    (trigger,) = keda["spec"]["triggers"]
    query = trigger["metadata"]["query"]
    used = set(re.findall(r"\bdwdp_[a-z_]+(?=\{)", query))
    assert used == {str(LoadMetric.OFFERED_LOAD)} and used <= NAMES
    podmonitor = (ROOT / "charts/dwdp-operator/templates/podmonitor.yaml").read_text()
    for label in re.findall(r"\b(dwdp_io_[a-z_]+)=", query):  # pod label dwdp.io/x -> series label dwdp_io_x
        assert label.replace("dwdp_io_", "dwdp.io/").replace("_", "-") in podmonitor, label
    assert trigger["metricType"] == "AverageValue" and float(trigger["metadata"]["threshold"]) > 0
