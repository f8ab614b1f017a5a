"""failurePolicy Degrade: the spec rule, the pure decision and the phase walk of ``desired_state`` (lose one pod
-> only it is deleted and recreated at the same attempt -> Ready again), and the group-restart fallbacks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_operator.degrade import pod_loss_errors
from dwdp_operator.desired import desired_state
from dwdp_operator.spec import DwdpGroupSpec, validate_spec
from .dwdp_op_util import cr, pods_from, spec, with_
from .test_op_crd import cel_errors

T0 = 1_000_000.0

def degrade_spec(**over):
    return spec(numGroups=1, failurePolicy="Degrade", experts={"replicas": 2}, **over)

def ready_group(raw):
    """A Ready group: (status, pods) after creation and every pod Running and Ready."""
    plan = desired_state(cr(raw), [], now=T0, token="t")
    pods = pods_from(plan)
    status = plan.status_after_creates or plan.status
    plan = desired_state(cr(raw, status), pods, now=T0 + 1)
    assert plan.status["groups"][0]["phase"] == "Ready"
    return plan.status, pods

def test_degrade_with_one_replica_is_refused_by_the_operator_and_by_cel():
    raw = spec(failurePolicy="Degrade")
    errs = validate_spec(raw)
    assert errs and "experts.replicas > gpusPerPod" in errs[0] and "losing pod 0" in errs[0], errs
    assert cel_errors(raw)
    assert not validate_spec(degrade_spec()) and not cel_errors(degrade_spec())
    two = degrade_spec(gpusPerPod=2)  # a pod of 2 ranks with 2 replicas: its first rank's experts go with it
    assert validate_spec(two) and cel_errors(two)

@settings(max_examples=200, deadline=None)
@given(d=st.integers(2, 8), g=st.integers(1, 8), r=st.integers(1, 8), n=st.integers(1, 24), k=st.integers(1, 24),
       s=st.integers(1, 24))
def test_property_pod_loss_rule_is_replicas_above_gpus_per_pod(d, g, r, n, k, s):
    raw = spec(dwdpSize=d, gpusPerPod=g, failurePolicy="Degrade",
               experts={"numExperts": n, "numExpertsPerWorker": k, "numPrefetchExperts": s, "replicas": r})
    if validate_spec({**raw, "failurePolicy": "RestartGroup"}):
        return  # a sharding refused anyway
    assert bool(pod_loss_errors(DwdpGroupSpec.model_validate(raw))) == (r <= g)
    assert bool(cel_errors(raw)) == bool(validate_spec(raw))

def test_one_failed_pod_is_recreated_alone_then_rejoins():
    raw = degrade_spec()
    status, pods = ready_group(raw)
    pods = with_(pods, "r1-g0-p2", phase="Failed", ready=False)
    plan = desired_state(cr(raw, status), pods, now=T0 + 10)
    g = plan.status["groups"][0]
    assert plan.deletes == [("Pod", "r1-g0-p2")]
    assert g["phase"] == "Degraded" and g["attempt"] == 0 and g["missingRanks"] == [2] and g["coverage"] == 1
    assert g["lostPods"][0]["uid"] == "u-r1-g0-p2-0" and plan.status["state"] == "Degraded"
    assert plan.status["reason"] == "RanksMissing" and plan.status["readyRanks"] == 3
    assert [e.reason for e in plan.events] == ["RankLost"] and "r1-g0-p2" in plan.events[0].message
    # the failed pod seen again (delete not observed yet): no second loss
    again = desired_state(cr(raw, plan.status), pods, now=T0 + 11)
    assert not [e for e in again.events if e.reason == "RankLost"] and again.deletes == [("Pod", "r1-g0-p2")]
    # gone: recreated with the same name and attempt, gang complete, no gate
    gone = [p for p in pods if p["name"] != "r1-g0-p2"]
    plan2 = desired_state(cr(raw, plan.status), gone, now=T0 + 12)
    created = [m for m in plan2.creates if m["kind"] == "Pod"]
    assert [m["metadata"]["name"] for m in created] == ["r1-g0-p2"] and not plan2.deletes
    assert created[0]["metadata"]["labels"]["dwdp.io/attempt"] == "0" and "schedulingGates" not in created[0]["spec"]
    st2 = plan2.status_after_creates or plan2.status
    assert st2["groups"][0]["phase"] == "Degraded"
    new = pods_from(plan2)
    new[0]["uid"] = "u-replacement"
    plan3 = desired_state(cr(raw, st2), gone + new, now=T0 + 20)
    g3 = plan3.status["groups"][0]
    assert g3["phase"] == "Ready" and "lostPods" not in g3 and g3["attempt"] == 0
    assert plan3.status["state"] == "Ready" and plan3.status["readyRanks"] == 4
    assert [e.reason for e in plan3.events] == ["RankRejoined", "RankRejoined"]
    assert g3["podRecreations"] and g3["groupRestarts"] == 0

def test_losing_coverage_restarts_the_group_and_says_why():
    raw = degrade_spec()
    status, pods = ready_group(raw)
    pods = with_(with_(pods, "r1-g0-p1", phase="Failed"), "r1-g0-p2", phase="Failed")  # ring neighbours
    plan = desired_state(cr(raw, status), pods, now=T0 + 10)
    g = plan.status["groups"][0]
    assert g["phase"] == "Restarting" and len(plan.deletes) == 4
    msg = [e.message for e in plan.events if e.reason == "GroupRestart"][0]
    assert "coverage lost" in msg and "no surviving holder" in msg

def test_budget_spent_restarts_the_group():
    raw = degrade_spec(degrade={"maxPodRecreations": 0})
    status, pods = ready_group(raw)
    plan = desired_state(cr(raw, status), with_(pods, "r1-g0-p0", phase="Failed"), now=T0 + 10)
    assert plan.status["groups"][0]["phase"] == "Restarting"
    assert "degrade.maxPodRecreations=0" in [e.message for e in plan.events if e.reason == "GroupRestart"][0]

def test_restart_group_policy_is_unchanged():
    raw = spec(numGroups=1, experts={"replicas": 2})
    status, pods = ready_group(raw)
    plan = desired_state(cr(raw, status), with_(pods, "r1-g0-p2", phase="Failed"), now=T0 + 10)
    assert plan.status["groups"][0]["phase"] == "Restarting" and len(plan.deletes) == 4
    assert "Degrade" not in plan.status["groups"][0]["lastRestartReason"]

def test_switching_the_policy_keeps_the_template_hash():
    from dwdp_operator.manifests import template_hash
    a = DwdpGroupSpec.model_validate(spec(experts={"replicas": 2}))
    b = DwdpGroupSpec.model_validate(spec(failurePolicy="Degrade", experts={"replicas": 2}, degrade={"windowSeconds": 5}))
    assert template_hash(a) == template_hash(b)

def test_a_pass_that_records_a_loss_writes_its_status_before_creating_the_replacement():
    """The lost pod already gone when the loss is seen: the pass only creates, yet its status (lostPods, the
    recreation budget spent) is written first (desired invariant 5a). Written after the create, a failed write
    would leave every pod there and the loss forgotten — the replacement free of the budget."""
    raw = degrade_spec()
    status, pods = ready_group(raw)
    gone = [p for p in pods if p["name"] != "r1-g0-p1"]
    plan = desired_state(cr(raw, status), gone, now=T0 + 10)
    assert [m["metadata"]["name"] for m in plan.creates if m["kind"] == "Pod"] == ["r1-g0-p1"]
    assert not plan.deletes and not plan.status_last and plan.status_after_creates is None
    g = plan.status["groups"][0]
    assert g["phase"] == "Degraded" and len(g["podRecreations"]) == 1 and g["lostPods"][0]["pod"] == 1
    # the next pass sees the replacement: the record written first is what it reads, the budget stays spent
    nxt = desired_state(cr(raw, plan.status), gone + pods_from(plan), now=T0 + 11)
    assert len(nxt.status["groups"][0]["podRecreations"]) == 1 and nxt.status["groups"][0]["groupRestarts"] == 0
