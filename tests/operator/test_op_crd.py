"""The CRD file: CEL rules agree with validate_spec (cel-python), defaults agree with the pydantic
model, the chart's copy is byte-identical, and the scale subresource / printer columns are wired."""

from pathlib import Path

import celpy
import pytest
import yaml

from dwdp_operator.spec import DwdpGroupSpec, validate_spec
from dwdp_op_util import spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds/dwdpgroup.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SPEC_SCHEMA = VERSION["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _apply_defaults(schema: dict, obj):
    """Structural-schema defaulting, as the API server does it (objects only; enough for our CRD)."""
    if schema.get("type") != "object" or not isinstance(obj, dict):
        return obj
    for key, sub in (schema.get("properties") or {}).items():
        if key not in obj and "default" in sub:
            obj[key] = yaml.safe_load(yaml.safe_dump(sub["default"]))
        if key in obj:
            obj[key] = _apply_defaults(sub, obj[key])
    return obj


def cel_errors(raw: dict) -> list[str]:
    obj = _apply_defaults(SPEC_SCHEMA, yaml.safe_load(yaml.safe_dump(raw)))
    env = celpy.Environment()
    out = []
    for rule in SPEC_SCHEMA["x-kubernetes-validations"]:
        prog = env.program(env.compile(rule["rule"]))
        if not bool(prog.evaluate({"self": celpy.json_to_cel(obj)})):
            out.append(rule["message"])
    return out


# cross-field cases: only CEL (and the operator) can catch these; bounds are the OpenAPI schema's job
CROSS_FIELD = {
    "valid": spec(),
    "valid-2gpu": spec(gpusPerPod=2),
    "valid-path": {**spec(), "model": {"path": "/models/r1"}},
    "valid-d3-256": spec(dwdpSize=3, experts={"numExperts": 256, "numExpertsPerWorker": 86, "numPrefetchExperts": 85}),
    "coverage": spec(experts={"numPrefetchExperts": 3}),
    "coverage-d3": spec(dwdpSize=3, experts={"numExperts": 256, "numExpertsPerWorker": 86, "numPrefetchExperts": 84}),
    "stride-gt-k": spec(experts={"numPrefetchExperts": 5}),
    "k-gt-n": spec(experts={"numExperts": 4, "numExpertsPerWorker": 5, "numPrefetchExperts": 1}),
    "gpus-not-dividing": spec(gpusPerPod=3),
    "one-slot": spec(experts={"numPrefetchSlots": 1}),
    "no-model": {**spec(), "model": {"dtype": "float16"}},
    "two-models": {**spec(), "model": {"path": "/m", "synthetic": "mixtral"}},
    "same-ports": spec(httpPort=9000, storePort=9000),
}


@pytest.mark.parametrize("case", sorted(CROSS_FIELD))
def test_cel_rules_agree_with_validate_spec(case):
    raw = CROSS_FIELD[case]
    assert bool(cel_errors(raw)) == bool(validate_spec(raw)), (case, cel_errors(raw), validate_spec(raw))
    assert bool(validate_spec(raw)) == (not case.startswith("valid")), case


def test_crd_defaults_match_the_pydantic_model():
    raw = {"dwdpSize": 4, "image": "i", "model": {"synthetic": "mixtral"},
           "experts": {"numExperts": 8, "numExpertsPerWorker": 2, "numPrefetchExperts": 2}}
    by_crd = _apply_defaults(SPEC_SCHEMA, yaml.safe_load(yaml.safe_dump(raw)))
    by_model = DwdpGroupSpec.model_validate(raw).model_dump(mode="json", exclude_none=True)
    # template lists/maps have no CRD default ({} is fine); compare every field the CRD defaults
    by_model["template"] = {}
    by_model.pop("resources")
    assert by_crd == by_model


def test_scale_subresource_and_printer_columns():
    assert VERSION["subresources"]["scale"] == {"specReplicasPath": ".spec.numGroups",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    assert "status" in VERSION["subresources"]
    cols = [c["name"].upper() for c in VERSION["additionalPrinterColumns"]]
    assert cols == ["GROUPS", "READY", "RESTARTS", "AGE"]
    assert CRD["spec"]["names"]["shortNames"] == ["dwdp"]


def test_chart_crd_is_byte_identical():
    assert (ROOT / "charts/dwdp-operator/crds/dwdpgroup.yaml").read_bytes() == (ROOT / "crds/dwdpgroup.yaml").read_bytes()
