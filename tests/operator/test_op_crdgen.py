"""crdgen (issue 33): the checked-in CRD and the chart's copy are what the pydantic models generate;
the generator's structural check refuses what the API server would; the printer columns and the
scale subresource name real fields; and every status the operator writes fits the generated status
schema (the API server prunes a field the schema lacks without a word)."""

from __future__ import annotations

import copy
import shutil

import pytest
import yaml
from pydantic import BaseModel

from dwdp_operator import crd_extras as X
from dwdp_operator import crdgen
from dwdp_operator.crdgen import OUTPUTS, REGENERATE, ROOT, CrdGenError, main, openapi_schema, render, structural_errors
from dwdp_operator.desired import desired_state
from dwdp_operator.status import with_refusals

from .dwdp_op_util import cr, pods_from, spec, with_
from .k8s_strict import instance_errors

OPENAPI = openapi_schema()
STATUS_SCHEMA = OPENAPI["properties"]["status"]
T0 = 1_000_000.0
# the line of the hand-written CRD that broke (issue 33): a comma inside a flow mapping starts a new key
BROKEN_FLOW_MAPPING = ("{type: string, minLength: 1, description: model directory (config.json + safetensors) inside "
                       "the pod, e.g. on a volume from template.volumes}")


@pytest.mark.parametrize("path", OUTPUTS, ids=str)
def test_the_checked_in_crd_is_the_generated_one(path):
    assert (ROOT / path).read_text() == render(), (
        f"{path} is not what the pydantic models generate: run `{REGENERATE}` (the repository root on "
        f"PYTHONPATH or the package installed) and commit the result; edit spec.py / status_schema.py / "
        f"crd_extras.py, never the YAML")


def test_check_mode_finds_a_stale_copy_and_a_run_makes_it_current(tmp_path, capsys):
    for p in OUTPUTS:
        (tmp_path / p).parent.mkdir(parents=True)
        shutil.copy(ROOT / p, tmp_path / p)
    stale = tmp_path / OUTPUTS[1]
    stale.write_text(stale.read_text().replace("maximum: 1024", "maximum: 2048"))
    assert main(["--root", str(tmp_path), "--check"]) == 1
    assert f"{OUTPUTS[1]} is not current: run {REGENERATE}" in capsys.readouterr().err
    assert main(["--root", str(tmp_path)]) == 0 and stale.read_text() == render()
    assert main(["--root", str(tmp_path), "--check"]) == 0
    assert main(["--root", str(tmp_path / "nowhere")]) == 2  # not a checkout: a message, no traceback
    assert "is not the repository root" in capsys.readouterr().err


def test_the_broken_flow_mapping_is_refused():
    node = yaml.safe_load(BROKEN_FLOW_MAPPING)
    assert node["e.g. on a volume from template.volumes"] is None  # the YAML trap itself
    assert structural_errors(node) == [
        "<root>: key 'e.g. on a volume from template.volumes' is not a schema keyword a CRD may use"]


def test_the_generated_schema_is_structural_and_describes_every_field():
    on_disk = yaml.safe_load((ROOT / OUTPUTS[0]).read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert on_disk == OPENAPI and structural_errors(on_disk) == []
    bad = copy.deepcopy(OPENAPI)
    bad["properties"]["spec"]["properties"]["sizing"] = {"anyOf": [{"type": "object"}, {"type": "null"}],
                                                         "$ref": "#/$defs/Sizing", "title": "Sizing"}
    assert structural_errors(bad) == [f".spec.sizing: key {k!r} is not a schema keyword a CRD may use"
                                      for k in ("anyOf", "$ref", "title")] + [".spec.sizing: no type"]


def test_a_union_is_refused_not_guessed():
    class Either(BaseModel):
        port: int | str

    js = Either.model_json_schema()
    with pytest.raises(CrdGenError, match=r"x\.port: a union of 2 types"):
        crdgen._node(js, {}, path="x", in_status=False)


def _field(path: str) -> dict:
    node = OPENAPI
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_printer_columns_and_the_scale_subresource_name_schema_fields():
    paths = [c.json_path for c in X.PRINTER_COLUMNS if not c.json_path.startswith(".metadata.")]
    paths += [X.SCALE_SUBRESOURCE["specReplicasPath"], X.SCALE_SUBRESOURCE["statusReplicasPath"],
              X.SCALE_SUBRESOURCE["labelSelectorPath"]]
    kinds = {"integer": "integer", "string": "string"}
    for column in X.PRINTER_COLUMNS:
        if column.type in kinds:
            assert _field(column.json_path)["type"] == kinds[column.type], column
    assert all(_field(p) for p in paths)


def _statuses():
    """Statuses the operator writes, from the plans of the common passes and apply's refusal record."""
    plan = desired_state(cr(), [], now=T0, token="t")
    yield "new", plan.status
    yield "after-creates", plan.status_after_creates
    obj = {**cr(), "status": plan.status_after_creates}
    pods = pods_from(plan)
    ready = desired_state(obj, pods, now=T0 + 1)
    yield "ready", ready.status
    obj = {**obj, "status": ready.status}
    failed = desired_state(obj, with_(pods, "r1-g0-p1", phase="Failed"), now=T0 + 2)
    yield "restarting", failed.status
    yield "draining", desired_state({**obj, "spec": spec(numGroups=1)}, pods, now=T0 + 3).status
    yield "invalid", desired_state(cr(spec(gpusPerPod=3), status=ready.status), pods, now=T0 + 4).status
    refused = [{"kind": "Pod", "reason": "PodQuotaExceeded", "message": "pods over quota; raise it"}]
    yield "refused", with_refusals(ready.status, refused, now=T0 + 5)
    sized = spec(experts={"numExperts": 256, "numExpertsPerWorker": 64, "numPrefetchExperts": 64},
                 sizing={"model": "deepseek-r1", "hardware": "gb200-nvl72", "weightDtype": "nvfp4"},
                 inferencePool={"endpointPicker": {"name": "epp"}})
    yield "sizing-and-pool", desired_state(cr(sized), [], now=T0).status


STATUSES = dict(_statuses())


@pytest.mark.parametrize("case", sorted(STATUSES))
def test_every_status_the_operator_writes_fits_the_status_schema(case):
    written = {k: v for k, v in STATUSES[case].items() if v is not None}  # null removes a key (merge patch)
    assert instance_errors(STATUS_SCHEMA, written) == []


def test_the_status_check_sees_a_field_the_server_would_prune():
    status = copy.deepcopy(STATUSES["ready"])
    status["groups"][0]["warmupSeconds"] = 3
    status["servingRanks"] = 8
    errors = instance_errors(STATUS_SCHEMA, status)
    assert len(errors) == 2 and all("Additional properties are not allowed" in e for e in errors), errors
