"""Pure core, one writer (issue 33): a reconcile pass computes ``desired_state`` once, and its status
after the creates (``Plan.status_after_creates``) is exactly what ``desired_state`` over the created
pods says, the second call the reconciler used to make; status is written by ``Applier._status``
alone. tests/k8s/test_k8s_one_pass.py counts both in real passes against the API server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dwdp_operator
from dwdp_operator.desired import desired_state
from dwdp_operator.observed import slim_pod
from .dwdp_op_util import L, cr, pods_from, spec

T0 = 1_000_000.0
PACKAGE = Path(dwdp_operator.__file__).parent


def _settled(obj):
    plan = desired_state(obj, [], now=T0, token="t")
    obj = {**obj, "status": plan.status_after_creates}
    return obj, pods_from(plan)


def _scenarios():
    yield "new", cr(), []
    refused = [{"kind": "Pod", "reason": "PodQuotaExceeded", "message": "exceeded quota"}]
    gated = desired_state(cr(status={"refusals": refused}), [], now=T0, token="t")
    partial = [p for p in pods_from(gated, phase="Pending", ready=False, gang="pending") if p["name"] != "r1-g0-p3"]
    yield "gated-partial-gang", cr(status={"refusals": refused}), partial
    whole = desired_state(cr(), [], now=T0, token="t")
    interrupted = [p for p in pods_from(whole, phase="Pending", ready=False) if p["name"] != "r1-g0-p3"]
    yield "interrupted-whole-create", cr(), interrupted
    obj, pods = _settled(cr())
    yield "scale-up", {**obj, "spec": {**obj["spec"], "numGroups": 3}}, pods
    sized = spec(dwdpSize=4, experts={"numExperts": 256, "numExpertsPerWorker": 64, "numPrefetchExperts": 64},
                 sizing={"model": "deepseek-r1", "hardware": "gb200-nvl72", "weightDtype": "nvfp4"},
                 inferencePool={"endpointPicker": {"name": "epp"}})
    yield "sizing-and-pool", cr(sized), []


SCENARIOS = {name: (obj, pods) for name, obj, pods in _scenarios()}


def _desired_over_created(obj, pods, plan):
    """The reconciler's former second ``desired_state``: over the pods plus the pods this pass creates."""
    seen = {p["name"] for p in pods}
    created = [slim_pod(m) for m in plan.creates if m["kind"] == "Pod" and m["metadata"]["name"] not in seen]
    return desired_state(obj, pods + created, now=T0, token="t").status


@pytest.mark.parametrize("case", sorted(SCENARIOS))
def test_status_after_creates_is_desired_state_over_the_created_pods(case):
    obj, pods = SCENARIOS[case]
    plan = desired_state(obj, pods, now=T0, token="t")
    assert plan.status_last and plan.status_after_creates == _desired_over_created(obj, pods, plan)
    creating = {m["metadata"]["labels"][L.GROUP] for m in plan.creates if m["kind"] == "Pod"}
    after = {str(g["index"]): g for g in plan.status_after_creates["groups"]}
    before = {str(g["index"]): g for g in plan.status["groups"]}
    # not vacuous: every creating group counts its new pods (and is a complete gang) only after the creates
    assert all(after[g]["gangComplete"] and after[g]["pods"] > before[g]["pods"] for g in creating), case


def test_a_pass_that_creates_no_pod_has_no_status_after_creates():
    obj, pods = _settled(cr())
    plan = desired_state(obj, pods, now=T0 + 1, token="t")
    assert not any(m["kind"] == "Pod" for m in plan.creates)
    assert plan.status_after_creates is None and not plan.status_last


def _calls(tree: ast.AST):
    """(enclosing function name, call node) for every call in ``tree``."""
    def walk(node, fn):
        for child in ast.iter_child_nodes(node):
            here = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else fn
            if isinstance(child, ast.Call):
                yield here, child
            yield from walk(child, here)
    yield from walk(tree, "<module>")


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _package_calls():
    for path in sorted(PACKAGE.rglob("*.py")):
        for fn, call in _calls(ast.parse(path.read_text())):
            yield path.relative_to(PACKAGE).as_posix(), fn, call


def test_one_desired_state_per_pass():
    """The reconciler calls ``desired_state`` at one place, in ``_once`` (one pass), outside any loop."""
    tree = ast.parse((PACKAGE / "reconciler.py").read_text())
    sites = [fn for fn, call in _calls(tree) if _name(call) == "desired_state"]
    assert sites == ["_once"], sites
    once = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "_once")
    loops = [n for n in ast.walk(once) if isinstance(n, (ast.For, ast.While, ast.AsyncFor, ast.comprehension))]
    assert not [c for loop in loops for c in ast.walk(loop) if isinstance(c, ast.Call) and _name(c) == "desired_state"]
    others = [(f, fn) for f, fn, call in _package_calls() if _name(call) == "desired_state" and f != "reconciler.py"]
    assert others == [], f"desired_state is the reconciler's to call: {others}"


def test_status_has_one_writer():
    """Only ``Applier._patch_status`` patches the status subresource, and only ``Applier._status`` calls it."""
    writers = [(f, fn) for f, fn, call in _package_calls()
               if any(k.arg == "subresource" and isinstance(k.value, ast.Constant) and k.value.value == "status"
                      for k in call.keywords)]
    assert writers == [("apply.py", "_patch_status")], writers
    callers = [(f, fn) for f, fn, call in _package_calls() if _name(call) == "_patch_status"]
    assert callers == [("apply.py", "_status")], callers
    refusal_records = [(f, fn) for f, fn, call in _package_calls() if _name(call) == "with_refusals"]
    assert {f for f, _ in refusal_records} == {"apply.py"}, refusal_records
