"""The CRD file: CEL rules agree with validate_spec (cel-python; a property test over random specs
inside the schema's bounds, plus named cases), defaults agree with the pydantic model, the chart's
copy is byte-identical, and the scale subresource / printer columns are wired."""

import re
from pathlib import Path

import celpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_operator.spec import DwdpGroupSpec, validate_spec
from .dwdp_op_util import spec

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


_ENV = celpy.Environment()


def _rule_sites(schema: dict, path: tuple[str, ...] = ()):
    """(path below spec, compiled rules) of every object schema that carries CEL rules: the spec's own and each
    nested object's (``self`` is that object), as the API server evaluates them."""
    rules = schema.get("x-kubernetes-validations") or []
    if rules:
        yield path, [(_ENV.program(_ENV.compile(r["rule"])), r["message"]) for r in rules]
    for key, sub in (schema.get("properties") or {}).items():
        yield from _rule_sites(sub, path + (key,))


RULE_SITES = list(_rule_sites(SPEC_SCHEMA))


def cel_errors(raw: dict) -> list[str]:
    """The messages of every CEL rule the defaulted spec breaks, a nested object's rules where it is present."""
    spec_obj = _apply_defaults(SPEC_SCHEMA, yaml.safe_load(yaml.safe_dump(raw)))
    errors = []
    for path, rules in RULE_SITES:
        obj = spec_obj
        for key in path:
            obj = obj.get(key) if isinstance(obj, dict) else None
        if obj is None:
            continue
        cel_obj = celpy.json_to_cel(obj)
        errors += [message for prog, message in rules if not bool(prog.evaluate({"self": cel_obj}))]
    return errors


def _bounded(path: str, lo: int, hi: int):
    """Integers inside both the CRD's bounds for ``path`` and [lo, hi] (small, to hit the edges)."""
    node = SPEC_SCHEMA
    for part in path.split("."):
        node = node["properties"][part]
    return st.integers(max(lo, node.get("minimum", lo)), min(hi, node.get("maximum", hi)))


@st.composite
def schema_valid_specs(draw):
    """Specs the OpenAPI schema admits (types, bounds, enums): only the cross-field rules decide.
    Left out on purpose: template.env (reserved names) and sizing (planner), operator-only rules."""
    model = draw(st.sampled_from([{"synthetic": "mixtral"}, {"path": "/models/m"},
                                  {"path": "/m", "synthetic": "qwen3_moe"}, {"dtype": "float16"}]))
    raw = {
        "numGroups": draw(_bounded("numGroups", 0, 3)),
        "dwdpSize": draw(_bounded("dwdpSize", 2, 9)),
        "gpusPerPod": draw(_bounded("gpusPerPod", 1, 9)),
        "image": "dwdp:test",
        "experts": {"numExperts": draw(_bounded("experts.numExperts", 1, 40)),
                    "numExpertsPerWorker": draw(_bounded("experts.numExpertsPerWorker", 1, 40)),
                    "numPrefetchExperts": draw(_bounded("experts.numPrefetchExperts", 1, 40)),
                    "numPrefetchSlots": draw(_bounded("experts.numPrefetchSlots", 2, 4)),
                    "replicas": draw(_bounded("experts.replicas", 1, 10))},
        "model": model,
        "imex": {"mode": draw(st.sampled_from(["ComputeDomain", "None"]))},
        # ports on both sides of the edges of an elastic group's store range (storePort .. storePort + dwdpSize)
        "httpPort": draw(st.sampled_from([8000, 9000, 9001, 9004, 9005, 9009, 9010])),
        "storePort": draw(st.sampled_from([9000, 29500, 65526, 65530, 65535])),
    }
    if draw(st.booleans()):  # graphs unset, off or on, beside elastic groups (replicas > 1) and --batch-invariant
        raw["serving"] = {"batchInvariant": draw(st.booleans())}
        graphs = draw(st.sampled_from([None, 0, 4]))
        if graphs is not None:
            raw["serving"]["cudaGraphs"] = graphs
    if draw(st.booleans()):  # the KV handoff's 64 ports below, on, and above that range
        raw["kvTransfer"] = {"budgetBytes": 0, "tcpPortBase": draw(st.sampled_from([8936, 8937, 9005, 9010, 30000]))}
    return raw


@settings(max_examples=600, deadline=None)
@given(schema_valid_specs())
def test_property_cel_and_validate_spec_accept_the_same_specs(raw):
    by_cel, by_operator = cel_errors(raw), validate_spec(raw)
    assert bool(by_cel) == bool(by_operator), (raw, by_cel, by_operator)


SNAKE_FIELDS = re.compile(r"\b(dwdp_size|num_experts|num_experts_per_worker|num_prefetch_experts|num_prefetch_slots|"
                          r"gpus_per_pod|http_port|store_port|expert_replicas)\b")


@settings(max_examples=300, deadline=None)
@given(schema_valid_specs())
def test_property_messages_use_the_spec_field_names(raw):
    for message in validate_spec(raw) + cel_errors(raw):
        assert not SNAKE_FIELDS.search(message), message


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
    # issue 19: (d-1)*s < N was missing from CEL: d=3, N=4, k=2, s=2 passed CEL, not validate_spec
    "last-rank-empty": spec(dwdpSize=3, experts={"numExperts": 4, "numExpertsPerWorker": 2, "numPrefetchExperts": 2}),
    "hgx-split-over-pods": spec(imex={"mode": "None"}),
    "valid-hgx-one-pod": spec(imex={"mode": "None"}, gpusPerPod=4),
    # issue 30: every expert on experts.replicas distinct ranks; a group of dwdpSize has no more
    "valid-replicas-2": spec(experts={"replicas": 2}),
    "valid-replicas-all": spec(experts={"replicas": 4}),
    "replicas-gt-size": spec(experts={"replicas": 5}),
    # issue 34: CUDA graphs are the default where they can run; a number > 0 in an elastic group is refused
    "valid-elastic-graphs-unset": spec(experts={"replicas": 2}, serving={"maxQueue": 8}),
    "valid-elastic-graphs-off": spec(experts={"replicas": 2}, serving={"cudaGraphs": 0}),
    "valid-graphs": spec(serving={"cudaGraphs": 8}),
    "elastic-graphs": spec(experts={"replicas": 2}, serving={"cudaGraphs": 8}),
    # a nested object's own rule (spec.serving's): found by the property test once cel_errors read only the spec's
    "batch-invariant-graphs": spec(serving={"batchInvariant": True, "cudaGraphs": 4}),
    "valid-batch-invariant-graphs-off": spec(serving={"batchInvariant": True, "cudaGraphs": 0}),
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
    cols = [c["name"].upper() for c in VERSION["additionalPrinterColumns"] if not c.get("priority")]
    assert cols == ["GROUPS", "READY", "RESTARTS", "STATUS", "REASON", "AGE"]
    wide = [c["jsonPath"] for c in VERSION["additionalPrinterColumns"] if c.get("priority") == 1]
    assert wide == [".status.readyRanks", ".spec.dwdpSize", ".spec.experts.numExpertsPerWorker", ".spec.experts.transfer",
                    ".spec.image"]
    assert CRD["spec"]["names"]["shortNames"] == ["dwdp"]


def test_chart_crd_is_byte_identical():
    assert (ROOT / "charts/dwdp-operator/crds/dwdpgroup.yaml").read_bytes() == (ROOT / "crds/dwdpgroup.yaml").read_bytes()


def _fields(schema: dict, path: str = ""):
    for key, sub in (schema.get("properties") or {}).items():
        here = f"{path}.{key}" if path else key
        yield here, sub
        yield from _fields(sub, here)
        if sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            yield from _fields(sub["items"], here + "[]")


def test_every_field_and_the_kind_are_described():
    root = VERSION["schema"]["openAPIV3Schema"]
    assert len(root.get("description", "")) > 100
    undescribed = [p for p, sub in _fields(root) if not sub.get("description")]
    assert not undescribed, f"kubectl explain shows nothing for: {undescribed}"


def test_spec_fields_of_the_crd_are_the_pydantic_model():
    def model_fields(model, path=""):
        for name, f in model.model_fields.items():
            here = f"{path}.{name}" if path else name
            yield here
            inner = f.annotation
            for cand in getattr(inner, "__args__", (inner,)):
                if isinstance(cand, type) and hasattr(cand, "model_fields") and name != "template":
                    yield from model_fields(cand, here)
    crd = {p for p, _ in _fields(SPEC_SCHEMA) if "[]" not in p and not p.startswith("template.")}
    assert crd == set(model_fields(DwdpGroupSpec)) - {p for p in model_fields(DwdpGroupSpec) if p.startswith("template.")}
