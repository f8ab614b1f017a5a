"""The InferencePool child (Gateway API Inference Extension, inference.networking.k8s.io/v1): its
manifest selects exactly the group's serving worker pods on their HTTP port, the spec field is
validated like the CRD says, and asking for a pool never restarts a group."""

import pytest
import yaml
from pydantic import ValidationError

from dwdp_operator import manifests as M
from dwdp_operator.spec import DwdpGroupSpec
from .dwdp_op_util import spec

from .test_op_manifests import ROOT

POOL = {"endpointPicker": {"name": "epp"}}


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_pool_selects_serving_worker_pods_on_the_http_port():
    sp = DwdpGroupSpec.model_validate(spec(httpPort=8100, inferencePool=POOL))
    pool = M.inference_pool(name="r1", ns="ns", uid="u", spec=sp)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "r1" and pool["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert pool["spec"]["targetPorts"] == [{"number": 8100}]
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    sel = pool["spec"]["selector"]["matchLabels"]
    pod = M.worker_pod(name="r1", ns="ns", uid="u", g=0, i=0, attempt=0, spec=sp, thash="h")
    assert pod["metadata"]["labels"]["llm-d.ai/role"] == "prefill" and _selects(sel, pod["metadata"]["labels"])
    draining = {**pod["metadata"]["labels"], **M.serving_patch(False)["metadata"]["labels"]}
    assert not _selects(sel, draining)  # a draining pod leaves the pool with the client Service
    other = M.worker_pod(name="r2", ns="ns", uid="v", g=0, i=0, attempt=0, spec=sp, thash="h")
    assert not _selects(sel, other["metadata"]["labels"])
    assert pod["spec"]["containers"][0]["ports"][0] == {"name": "http", "containerPort": 8100}


def test_asking_for_a_pool_does_not_change_the_template_hash():
    plain = DwdpGroupSpec.model_validate(spec())
    pooled = DwdpGroupSpec.model_validate(spec(inferencePool=POOL))
    assert M.template_hash(plain) == M.template_hash(pooled)


@pytest.mark.parametrize("bad", [{}, {"endpointPicker": {}}, {"endpointPicker": {"name": ""}},
                                 {"endpointPicker": {"name": "e", "port": 0}},
                                 {"endpointPicker": {"name": "e", "failureMode": "Sometimes"}},
                                 {"endpointPicker": {"name": "e"}, "extra": 1}])
def test_bad_pool_specs_are_refused(bad):
    with pytest.raises(ValidationError):
        DwdpGroupSpec.model_validate(spec(inferencePool=bad))


def test_crd_schema_has_the_same_pool_field():
    crd = yaml.safe_load((ROOT / "crds/dwdpgroup.yaml").read_text())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    pool = props["inferencePool"]
    assert pool["required"] == ["endpointPicker"]
    epp = pool["properties"]["endpointPicker"]
    assert epp["required"] == ["name"] and epp["properties"]["port"]["default"] == 9002
    assert epp["properties"]["failureMode"]["enum"] == ["FailOpen", "FailClose"]


def test_desired_state_creates_the_pool_when_asked_and_deletes_it_once_when_not():
    from dwdp_operator.desired import desired_state

    from .dwdp_op_util import cr

    plan = desired_state(cr(spec(inferencePool=POOL)), [], now=0.0, token="t")
    pools = [m for m in plan.creates if m["kind"] == "InferencePool"]
    assert len(pools) == 1 and plan.status["inferencePool"] == "r1"
    plain = desired_state(cr(spec()), [], now=0.0, token="t")
    assert not [m for m in plain.creates if m["kind"] == "InferencePool"] and "inferencePool" not in plain.status
    assert not [d for d in plain.deletes if d[0] == "InferencePool"]
    dropped = desired_state(cr(spec(), status=plan.status), [], now=0.0, token="t")
    assert ("InferencePool", "r1") in dropped.deletes and dropped.status["inferencePool"] is None


def test_a_pod_without_the_role_label_gets_it_patched():
    from dwdp_operator.desired import desired_state

    from .dwdp_op_util import cr, pods_from

    first = desired_state(cr(spec()), [], now=0.0, token="t")
    pods = pods_from(first)
    assert all(p["labels"]["llm-d.ai/role"] == "prefill" for p in pods)
    del pods[0]["labels"]["llm-d.ai/role"]  # created by an operator before the label existed
    plan = desired_state(cr(spec(), status=first.status), pods, now=1.0, token="t")
    assert (pods[0]["name"], M.role_patch()) in plan.patches
    assert not [n for n, p in plan.patches if p == M.role_patch() and n != pods[0]["name"]]
