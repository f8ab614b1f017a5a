"""spec.autoscaling: validation (pydantic bounds, the registered cross-field rules, the CRD's CEL rules — one
verdict), no roll of the groups, the adapter against real HTTP load reports, and the drain that waits for
in-flight prefill (desired_state's busy groups)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import celpy
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_operator import manifests as M
from dwdp_operator.autoscale import ScaleReason
from dwdp_operator.autoscaler import Autoscaler
from dwdp_operator.desired import DRAIN_BUSY_CAP_S, desired_state
from dwdp_operator.spec import parse_spec, validate_spec
from dwdp_operator.state import EventReason
from dwdp_runtime.load.schema import NUM_BUCKETS, BucketLoad, ForwardCost, LoadReport, bucket_edge

from .dwdp_op_util import cr, pods_from, spec

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds/dwdpgroup.yaml").read_text())
AUTO_SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["autoscaling"]
AUTO = {"maxGroups": 8, "targetTTFTSeconds": 2.0}


def _with(**auto) -> dict:
    return spec(autoscaling={**AUTO, **auto})


# -- validation -------------------------------------------------------------------------------------
@pytest.mark.parametrize("auto,needle", [
    ({"minGroups": 5, "maxGroups": 3}, "spec.autoscaling.minGroups=5 is above spec.autoscaling.maxGroups=3"),
    ({"targetTTFTSeconds": None}, "set targetTTFTSeconds"),
    ({"targetTTFTSeconds": 0}, "spec.autoscaling.targetTTFTSeconds: Input should be greater than 0"),
    ({"targetQueueSeconds": -1}, "spec.autoscaling.targetQueueSeconds: Input should be greater than 0"),
    ({"minGroups": 0}, "spec.autoscaling.minGroups: Input should be greater than or equal to 1"),
    ({"maxStep": 0}, "spec.autoscaling.maxStep"),
    ({"maxGroup": 3}, "spec.autoscaling.maxGroup: Extra inputs are not permitted"),
])
def test_bad_settings_are_refused_naming_the_field(auto, needle):
    raw = _with(**auto)
    raw["autoscaling"] = {k: v for k, v in raw["autoscaling"].items() if v is not None}
    errors = validate_spec(raw)
    assert any(needle in e for e in errors), errors


def test_good_settings_pass_and_take_the_defaults():
    parsed, errors = parse_spec(_with())
    assert errors == []
    a = parsed.autoscaling
    assert (a.minGroups, a.scaleUpStabilizationSeconds, a.scaleDownStabilizationSeconds, a.maxStep, a.intervalSeconds) \
        == (1, 30, 120, 10, 5)


_ENV = celpy.Environment()
RULES = [(_ENV.program(_ENV.compile(r["rule"])), r["message"]) for r in AUTO_SCHEMA["x-kubernetes-validations"]]


def _cel_errors(auto: dict) -> list[str]:
    defaulted = {**{k: v["default"] for k, v in AUTO_SCHEMA["properties"].items() if "default" in v}, **auto}
    obj = celpy.json_to_cel(defaulted)
    return [m for prog, m in RULES if not bool(prog.evaluate({"self": obj}))]


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"maxGroups": st.integers(1, 6)},
                             optional={"minGroups": st.integers(1, 6), "targetTTFTSeconds": st.floats(0.01, 10),
                                       "targetQueueSeconds": st.floats(0.01, 10)}))
def test_property_cel_and_validate_spec_agree_on_autoscaling(auto):
    assert bool(_cel_errors(auto)) == bool(validate_spec(spec(autoscaling=auto))), auto


def test_crd_defaults_are_the_models():
    parsed, _ = parse_spec(_with())
    model = parsed.autoscaling.model_dump()
    for key, sub in AUTO_SCHEMA["properties"].items():
        if "default" in sub:
            assert sub["default"] == model[key], key


def test_autoscaling_never_rolls_the_groups():
    assert M.template_hash(parse_spec(spec())[0]) == M.template_hash(parse_spec(_with())[0])


# -- the adapter against real HTTP reports ------------------------------------------------------------
class Reports:
    """A real HTTP server answering GET /load/<namespace>/<pod> with a LoadReport per pod."""

    def __init__(self):
        self.by_pod: dict[str, LoadReport] = {}
        outer = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                pod = self.path.rstrip("/").split("/")[-1]
                r = outer.by_pod.get(pod)
                body = b"not found" if r is None else json.dumps(r.model_dump(mode="json")).encode()
                self.send_response(404 if r is None else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.template = f"http://127.0.0.1:{self.httpd.server_address[1]}/load/{{namespace}}/{{pod}}"

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def reports(monkeypatch):
    r = Reports()
    monkeypatch.setenv("DWDP_OPERATOR_LOAD_URL", r.template)
    yield r
    r.close()


def _load(arrivals: float, *, waiting: int = 0, running: int = 0) -> LoadReport:
    buckets = [BucketLoad(isl_le=bucket_edge(i)) for i in range(NUM_BUCKETS)]
    buckets[3] = BucketLoad(isl_le=bucket_edge(3), arrival_tokens_per_second=arrivals, waiting_tokens=waiting,
                            running_tokens=running)
    cost = ForwardCost(floor_seconds=0.75, max_tokens=1e9, max_pairs=1e18, weight=100.0)
    return LoadReport(ready=True, ranks=1, max_num_tokens=16384, buckets=buckets, forward_seconds=0.75,
                      forward_cost=cost, waiting_prefill_tokens=waiting, running_prefill_tokens=running)


def _settled(raw_spec: dict):
    obj = cr(raw_spec)
    plan = desired_state(obj, [], now=0.0)
    return {**obj, "status": plan.status}, pods_from(plan)


def test_observe_decides_when_due_and_reads_only_draining_pods_in_between(reports):
    obj, pods = _settled(_with(maxGroups=8))
    for p in pods:
        reports.by_pod[p["name"]] = _load(200_000)
    a = Autoscaler()
    tick = a.observe(("ns", "r1"), obj, pods, port=8000, namespace="ns", now=100.0)
    assert tick.decision is not None and tick.decision.reason == ScaleReason.PANIC and tick.decision.desired > 2
    assert tick.status["desiredGroups"] == tick.decision.desired and tick.status["currentGroups"] == 2
    assert tick.status["signals"]["pods"] == len(pods) and tick.wake == 5
    assert [e.reason for e in tick.events] == [EventReason.AUTOSCALE_UP]
    again = a.observe(("ns", "r1"), obj, pods, port=8000, namespace="ns", now=102.0)
    assert again.decision is None and again.status is None and again.wake == pytest.approx(3.0)


def test_a_manual_numgroups_edit_is_explained_and_decided_from(reports):
    obj, pods = _settled(_with(maxGroups=8))
    for p in pods:
        reports.by_pod[p["name"]] = _load(1000)
    obj["status"]["autoscaling"] = {"desiredGroups": 1}   # the autoscaler's last word; numGroups is 2 now
    tick = Autoscaler().observe(("ns", "r1"), obj, pods, port=8000, namespace="ns", now=100.0)
    warn = [e for e in tick.events if e.reason == EventReason.MANUAL_SCALE_OVERRIDDEN]
    assert warn and "spec.numGroups was set to 2 outside the autoscaler" in warn[0].message
    assert "remove spec.autoscaling" in warn[0].message


def test_unreachable_pods_are_no_signal_and_removing_autoscaling_clears_its_status(reports):
    obj, pods = _settled(_with())
    a = Autoscaler()
    tick = a.observe(("ns", "r1"), obj, pods, port=8000, namespace="ns", now=1.0)
    assert tick.decision.reason == ScaleReason.NO_SIGNAL and tick.decision.desired == 2
    obj = {**obj, "spec": spec(), "status": {**obj["status"], "autoscaling": tick.status}}
    cleared = a.observe(("ns", "r1"), obj, pods, port=8000, namespace="ns", now=2.0)
    assert cleared.status == {} and cleared.decision is None


def test_busy_draining_groups_are_kept_until_idle_or_the_cap(reports):
    obj, pods = _settled(spec(numGroups=3))
    obj = {**obj, "spec": spec(numGroups=1)}
    for p in pods:
        reports.by_pod[p["name"]] = _load(0, running=4000 if p["group"] == 2 else 0)
    tick = Autoscaler().observe(("ns", "r1"), obj, pods, port=8000, namespace="ns", now=0.0)
    assert tick.busy_groups == frozenset({2})
    plan = desired_state(obj, pods, now=0.0, drain_seconds=5)
    obj = {**obj, "status": plan.status}
    later = desired_state(obj, pods, now=6.0, busy_groups=tick.busy_groups)
    deleted = {n for _, n in later.deletes}
    assert deleted == {f"r1-g1-p{i}" for i in range(4)}  # idle group 1 goes; group 2 still prefills
    assert later.requeue_after is not None and later.requeue_after <= 1.0
    capped = desired_state(obj, pods, now=5.0 + DRAIN_BUSY_CAP_S + 1, busy_groups=tick.busy_groups)
    assert {n for _, n in capped.deletes} >= {f"r1-g2-p{i}" for i in range(4)}
