"""Every manifest we ship, checked strictly without a server (issue 33): the CRD (both copies) and the
chart's rendered templates (``helm template`` over the value sets that switch templates on) against the
``kubernetes`` client's models, with a round trip that refuses any key a model would drop; the chart's
example DwdpGroup and ``examples/*.yaml`` against the generated CRD schema and ``validate_spec``; and
the children the operator creates, the same way. The API server drops an unknown field of a built-in
kind and prunes one of a custom resource without a word: these checks are where such a typo shows.

Not checked beyond their metadata: the Prometheus Operator's ServiceMonitor and PodMonitor (no schema
of theirs is available offline) and the ComputeDomain (NVIDIA's CRD; tests/k8s has only a schemaless
stand-in). The InferencePool is checked against tests/k8s/crds/inferencepool.yaml, a stand-in that keeps
v1's shape."""

from __future__ import annotations

import copy
import os
import subprocess

import pytest
import yaml

from dwdp_operator.crdgen import OUTPUTS, ROOT, openapi_schema
from dwdp_operator.desired import desired_state
from dwdp_operator.spec import validate_spec

from .dwdp_op_util import cr, spec
from .k8s_strict import custom_resource_errors, has_model, helm, model_errors, roundtrip_errors
from .test_op_crdgen import BROKEN_FLOW_MAPPING

CHART = ROOT / "charts/dwdp-operator"
# kinds of other projects' CRDs the chart or the examples can render: only their metadata is checked (module docstring);
# KEDA's ScaledObject (examples/autoscaling-keda.yaml) has its signal names held by test_op_autoscale_recipes.py
METADATA_ONLY = {"ServiceMonitor", "PodMonitor", "ComputeDomain", "ScaledObject"}
# value sets that together render every template of the chart (each branch of rbac.yaml too)
VALUE_SETS = {
    "defaults": [],
    "everything-on": ["--set", "example.enabled=true", "--set", "monitoring.serviceMonitor.enabled=true",
                      "--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.dashboard.enabled=true",
                      "--set", "gatewayInferenceExtension.enabled=true", "--set", "watchNamespaces={a,b-*}",
                      "--set", "imagePullSecrets[0].name=regcred", "--set", "tolerations[0].operator=Exists",
                      "--set", "nodeSelector.pool=cpu", "--set", "podAnnotations.team=ml"],
    "literal-namespaces": ["--set", "watchNamespaces={a,b}", "--set", "monitoring.podMonitor.enabled=true"],
    "no-rbac-no-metrics": ["--set", "rbac.create=false", "--set", "serviceAccount.create=false",
                           "--set", "metrics.enabled=false"],
}
INFERENCE_POOL_SCHEMA = yaml.safe_load((ROOT / "tests/k8s/crds/inferencepool.yaml").read_text())[
    "spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _crd(path=OUTPUTS[0]) -> dict:
    return yaml.safe_load((ROOT / path).read_text())


def _helm_template(args: list[str], tmp_path) -> str:
    env = dict(os.environ, HELM_CACHE_HOME=str(tmp_path / "c"), HELM_CONFIG_HOME=str(tmp_path / "f"),
               HELM_DATA_HOME=str(tmp_path / "d"))
    out = subprocess.run([helm(), "template", "rel", str(CHART), "--include-crds", *args], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _rendered(args: list[str], tmp_path) -> list[dict]:
    return [d for d in yaml.safe_load_all(_helm_template(args, tmp_path)) if d]


def strict_errors(doc: dict) -> list[str]:
    """What the strictest check we have for ``doc``'s kind finds (``[]``: nothing)."""
    if has_model(doc):
        return model_errors(doc)
    if doc["kind"] == "DwdpGroup":
        return custom_resource_errors(openapi_schema(), doc) + validate_spec(doc["spec"])
    if doc["kind"] == "InferencePool":
        return custom_resource_errors(INFERENCE_POOL_SCHEMA, doc)
    assert doc["kind"] in METADATA_ONLY, f"no strict check for kind {doc['kind']}: add one"
    return roundtrip_errors(doc["metadata"], "V1ObjectMeta", ".metadata")


@pytest.mark.parametrize("path", OUTPUTS, ids=str)
def test_the_crd_passes_the_client_model(path):
    assert model_errors(_crd(path)) == []


def test_the_client_model_check_refuses_the_broken_hand_written_crd():
    """The two keys a comma inside a flow mapping added (issue 33); the second one sits below an
    array's items, which the model keeps as a raw dict: the check reads every schema node."""
    crd = _crd()
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    schema["spec"]["properties"]["model"]["properties"]["path"] = yaml.safe_load(BROKEN_FLOW_MAPPING)
    message = schema["status"]["properties"]["refusals"]["items"]["properties"]["message"]
    message["the API server's words and the fix"] = None
    errors = model_errors(crd)
    root = ".spec.versions[0].schema.openAPIV3Schema.properties"
    assert errors == [
        f"{root}.spec.properties.model.properties.path.e.g. on a volume from template.volumes: unknown key "
        "(dropped by the model)",
        f"{root}.status.properties.refusals.items.properties.message.the API server's words and the fix: unknown key "
        "(dropped by the model)"], errors


@pytest.mark.parametrize("values", sorted(VALUE_SETS))
def test_every_rendered_chart_manifest_is_strictly_valid(values, tmp_path):
    docs = _rendered(VALUE_SETS[values], tmp_path)
    assert docs
    errors = {f"{d['kind']}/{d['metadata']['name']}": strict_errors(d) for d in docs}
    assert {k: v for k, v in errors.items() if v} == {}


def test_every_template_is_rendered_by_some_value_set(tmp_path):
    sources = {line.removeprefix("# Source: ") for args in VALUE_SETS.values()
               for line in _helm_template(args, tmp_path).splitlines() if line.startswith("# Source: ")}
    templates = {f"dwdp-operator/templates/{p.name}" for p in (CHART / "templates").glob("*.yaml")}
    assert "dwdp-operator/crds/dwdpgroup.yaml" in sources and templates - sources == set()


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT) for p in (ROOT / "examples").glob("*.yaml")), ids=str)
def test_every_example_is_strictly_valid(path):
    docs = [d for d in yaml.safe_load_all((ROOT / path).read_text()) if d]
    assert docs and [strict_errors(d) for d in docs] == [[] for _ in docs]


def test_the_check_sees_a_misspelt_field_of_a_rendered_deployment(tmp_path):
    deployment = next(d for d in _rendered([], tmp_path) if d["kind"] == "Deployment")
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    assert strict_errors(deployment) == []
    assert strict_errors(bad) == [".spec.template.spec.containers[0].imagePullPolicyy: unknown key (dropped by "
                                  "the model)"]


def test_every_child_the_operator_creates_is_strictly_valid():
    # resources as the API's canonical strings: the client's Quantity is a str (the server also takes numbers)
    full = spec(inferencePool={"endpointPicker": {"name": "epp"}}, kvTransfer={"budgetBytes": 1 << 30},
                experts={"replicas": 2},  # elastic: the pod address template, the standby stores' port range
                serving={"maxQueue": 10, "servedModelName": "m"}, resources={"limits": {"cpu": "2", "memory": "1Gi"}},
                template={"env": [{"name": "HF_HOME", "value": "/m"}], "volumes": [{"name": "m", "emptyDir": {}}],
                          "volumeMounts": [{"name": "m", "mountPath": "/m"}],
                          "tolerations": [{"key": "gpu", "operator": "Exists"}], "nodeSelector": {"pool": "gpu"}})
    for raw in (spec(), full, spec(imex={"mode": "None"}, gpusPerPod=4)):
        plan = desired_state(cr(raw), [], now=0.0, token="t")
        assert plan.valid, plan.status
        errors = {f"{m['kind']}/{m['metadata']['name']}": strict_errors(m) for m in plan.creates}
        assert {k: v for k, v in errors.items() if v} == {}
        assert {m["kind"] for m in plan.creates} >= {"Pod", "Service", "Secret", "NetworkPolicy"}
