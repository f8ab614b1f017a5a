"""desired_state: the pure plan for create, gang, restart, backoff, Failed, scaling, rollout, invalid."""

from dwdp_operator import labels as L
from dwdp_operator.desired import desired_state
from dwdp_operator.status import iso
from dwdp_operator.restart import backoff_seconds, exhausted
from dwdp_operator.observed import slim_pod
from .dwdp_op_util import cr, pods_from, spec, with_

T0 = 1_000_000.0


def pod_creates(plan):
    return sorted(m["metadata"]["name"] for m in plan.creates if m["kind"] == "Pod")


def group(plan, g):
    return next(x for x in plan.status["groups"] if x["index"] == g)


def settle(obj, *, now=T0):
    """Run one pass and feed back status + ready pods, as the API and kubelet would."""
    plan = desired_state(obj, [], now=now)
    obj = {**obj, "status": plan.status}
    pods = pods_from(plan)
    plan = desired_state(obj, pods, now=now)
    return {**obj, "status": plan.status}, pods, plan


def test_create_plans_every_child():
    plan = desired_state(cr(), [], now=T0, token="t")
    kinds = sorted({m["kind"] for m in plan.creates})
    assert kinds == ["ComputeDomain", "NetworkPolicy", "Pod", "Secret", "Service"]
    assert pod_creates(plan) == [f"r1-g{g}-p{i}" for g in range(2) for i in range(4)]
    svcs = sorted(m["metadata"]["name"] for m in plan.creates if m["kind"] == "Service")
    assert svcs == ["r1", "r1-ranks"]  # the client Service and one headless Service for every group's ranks
    nps = sorted(m["metadata"]["name"] for m in plan.creates if m["kind"] == "NetworkPolicy")
    assert nps == ["r1"]
    for m in plan.creates:
        assert m["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert [g["phase"] for g in plan.status["groups"]] == ["Pending", "Pending"]
    assert plan.status["selector"] == "dwdp.io/name=r1"


def test_idempotent_when_all_ready():
    obj, pods, plan = settle(cr())
    again = desired_state(obj, pods, now=T0 + 1)
    assert pod_creates(again) == [] and again.deletes == [] and again.patches == []
    assert again.status["readyGroups"] == 2
    assert {c["type"]: c["status"] for c in again.status["conditions"]} == {
        "Ready": "True", "Progressing": "False", "Degraded": "False", "Invalid": "False", "ChildrenAccepted": "True"}
    assert (again.status["state"], again.status["reason"]) == ("Ready", "AllGroupsReady")
    assert again.requeue_after is None  # nothing time-based pending: only events wake the reconciler
    assert again.status == desired_state(obj, pods, now=T0 + 2).status


def _pod_manifests(plan):
    return {m["metadata"]["name"]: m for m in plan.creates if m["kind"] == "Pod"}


def test_a_group_with_no_pod_is_created_whole_and_its_status_written_once():
    plan = desired_state(cr(), [], now=T0, token="t")
    pods = _pod_manifests(plan)
    assert all("schedulingGates" not in m["spec"] and m["metadata"]["labels"][L.GANG] == "complete"
               for m in pods.values())
    assert plan.whole_gangs == [[f"r1-g{g}-p{i}" for i in range(4)] for g in range(2)]
    assert plan.status_last and not plan.patches
    # the pass's one status write: its status with the pods it creates counted (what the next pass observes)
    after = plan.status_after_creates
    assert after == desired_state(cr(), [slim_pod(m) for m in pods.values()], now=T0, token="t").status
    assert [g["gangComplete"] for g in after["groups"]] == [True, True]
    observed = pods_from(plan, phase="Pending", ready=False, gang="complete")
    again = desired_state({**cr(), "status": after}, observed, now=T0 + 1)
    assert again.status == after and not again.patches and not pod_creates(again)


def test_a_refused_child_on_record_makes_gangs_gated():
    refused = [{"kind": "Pod", "reason": "PodQuotaExceeded", "message": "exceeded quota"}]
    plan = desired_state(cr(status={"refusals": refused}), [], now=T0)
    assert plan.whole_gangs == []
    assert all(m["spec"]["schedulingGates"] == [{"name": L.GANG_GATE}] and m["metadata"]["labels"][L.GANG] == "pending"
               for m in _pod_manifests(plan).values())


def test_an_interrupted_whole_create_is_completed_not_restarted():
    plan = desired_state(cr(), [], now=T0)
    # the operator died after 3 pods of group 0 and before its status write: pods say complete, status nothing
    pods = [p for p in pods_from(plan, phase="Pending", ready=False, gang="complete") if p["name"] != "r1-g0-p3"]
    plan2 = desired_state(cr(), pods, now=T0 + 1)
    assert not _failure_events(plan2) and "r1-g0-p3" in pod_creates(plan2)
    p3 = _pod_manifests(plan2)["r1-g0-p3"]
    assert p3["spec"]["schedulingGates"] == [{"name": L.GANG_GATE}]  # the rest of a started gang: gated path
    assert [g for g in plan2.whole_gangs if "r1-g0-p3" in g] == []


def test_a_rolled_back_pod_still_terminating_neither_completes_the_gang_nor_fails_it():
    plan = desired_state(cr(), [], now=T0)
    pods = with_(pods_from(plan, phase="Pending", ready=False, gang="complete"), "r1-g0-p1", deleting=True)
    plan2 = desired_state(cr(), pods, now=T0 + 1)
    assert not _failure_events(plan2) and not group(plan2, 0)["gangComplete"] and group(plan2, 1)["gangComplete"]
    assert "r1-g0-p1" not in pod_creates(plan2)  # re-created once it is gone (same name)
    assert "r1-g0-p1" in pod_creates(desired_state(cr(), [p for p in pods if p["name"] != "r1-g0-p1"], now=T0 + 2))


def test_a_new_attempt_writes_its_status_before_its_pods():
    obj, pods, _ = settle(cr())
    gone = [p for p in pods if p["name"] != "r1-g1-p2"]
    plan = desired_state(obj, gone, now=T0 + 5)
    obj = {**obj, "status": plan.status}
    survivors = [p for p in pods if p["group"] == 0]
    plan = desired_state(obj, survivors, now=T0 + 5 + backoff_seconds(0, base=10) + 1)
    assert group(plan, 1)["attempt"] == 1 and pod_creates(plan) == [f"r1-g1-p{i}" for i in range(4)]
    assert plan.whole_gangs == [[f"r1-g1-p{i}" for i in range(4)]]
    assert not plan.status_last  # invariant 1: attempt+1 is on record before any pod of it exists


def test_gang_gate_lifted_only_when_every_pod_exists():
    plan = desired_state(cr(), [], now=T0)
    pods = pods_from(plan, phase="Pending", ready=False, gang="pending")
    partial = [p for p in pods if p["name"] != "r1-g0-p3"]
    plan2 = desired_state({**cr(), "status": plan.status}, partial, now=T0)
    lifted = {n for n, patch in plan2.patches if patch["metadata"]["labels"].get(L.GANG) == "complete"}
    assert lifted == {f"r1-g1-p{i}" for i in range(4)}
    assert pod_creates(plan2) == ["r1-g0-p3"]
    assert not _failure_events(plan2)  # a missing pod before the gang completes is not a failure


def _failure_events(plan):
    return [e for e in plan.events if e[1] in ("GroupRestart", "GroupFailed")]


def test_killed_pod_restarts_group_after_backoff_with_attempt_plus_one():
    obj, pods, _ = settle(cr())
    gone = [p for p in pods if p["name"] != "r1-g1-p2"]
    plan = desired_state(obj, gone, now=T0 + 5)
    g1 = group(plan, 1)
    assert g1["phase"] == "Restarting" and g1["groupRestarts"] == 1 and g1["attempt"] == 0
    assert "r1-g1-p2 disappeared" in g1["lastRestartReason"]
    assert sorted(n for k, n in plan.deletes) == [f"r1-g1-p{i}" for i in (0, 1, 3)]
    assert _failure_events(plan)[0][0] == "Warning"
    obj = {**obj, "status": plan.status}
    survivors = [p for p in gone if not p["name"].startswith("r1-g1")]
    early = desired_state(obj, survivors, now=T0 + 5 + 9)  # backoff 10 s not over yet
    assert pod_creates(early) == [] and group(early, 1)["phase"] == "Restarting"
    due = desired_state(obj, survivors, now=T0 + 5 + 10)
    assert pod_creates(due) == [f"r1-g1-p{i}" for i in range(4)]
    assert {m["metadata"]["labels"][L.ATTEMPT] for m in due.creates if m["kind"] == "Pod"} == {"1"}
    assert group(due, 1)["attempt"] == 1 and group(due, 0)["attempt"] == 0


def test_no_new_attempt_while_old_pods_terminate():
    obj, pods, _ = settle(cr())
    plan = desired_state(obj, with_(pods, "r1-g0-p0", phase="Failed"), now=T0)
    obj = {**obj, "status": plan.status}
    terminating = [dict(p, deleting=p["group"] == 0) for p in pods]
    later = desired_state(obj, terminating, now=T0 + 3600)
    assert pod_creates(later) == [] and group(later, 0)["attempt"] == 0


def test_whole_group_vanishing_is_a_failure():
    obj, pods, _ = settle(cr())
    plan = desired_state(obj, [p for p in pods if p["group"] == 0], now=T0)
    assert group(plan, 1)["phase"] == "Restarting" and pod_creates(plan) == []


def test_container_restart_and_failed_phase_are_failures():
    obj, pods, _ = settle(cr())
    p1 = desired_state(obj, with_(pods, "r1-g0-p1", restarts=1), now=T0)
    assert group(p1, 0)["phase"] == "Restarting"
    p2 = desired_state(obj, with_(pods, "r1-g1-p0", phase="Failed"), now=T0)
    assert group(p2, 1)["phase"] == "Restarting"


def test_restart_storm_backoff_grows_then_failed():
    obj, pods, _ = settle(cr(spec(numGroups=1)))
    now, delays = T0, []
    for _ in range(3):
        live = [p for p in pods if p["group"] == 0]
        plan = desired_state(obj, with_(live, "r1-g0-p0", restarts=1), now=now)
        st = group(plan, 0)
        if st["phase"] == "Failed":
            break
        delays.append(round((_t(st["restartAt"]) - now)))
        obj = {**obj, "status": plan.status}
        now = _t(st["restartAt"])
        plan = desired_state(obj, [], now=now)
        obj = {**obj, "status": plan.status}
        pods = pods_from(plan)
    assert delays == [10, 20]
    assert st["phase"] == "Failed" and st["groupRestarts"] == 2 and len(st["history"]) == 3
    assert any(e[1] == "GroupFailed" for e in plan.events)
    deg = next(c for c in plan.status["conditions"] if c["type"] == "Degraded")
    assert deg["status"] == "True" and "Failed" in deg["message"]
    # a Failed group stays down on later passes
    obj = {**obj, "status": plan.status}
    assert pod_creates(desired_state(obj, [], now=now + 1000)) == []


def _t(s):
    from dwdp_operator.status import parse_iso
    return parse_iso(s)


def test_scale_down_drains_highest_groups_then_removes():
    obj, pods, _ = settle(cr(spec(numGroups=3)))
    obj = {**obj, "spec": spec(numGroups=1)}
    plan = desired_state(obj, pods, now=T0, drain_seconds=5)
    assert [group(plan, g)["phase"] for g in (1, 2)] == ["Draining", "Draining"]
    assert plan.deletes == []
    unserve = {n for n, p in plan.patches if p["metadata"]["labels"].get(L.SERVING) == "false"}
    assert unserve == {f"r1-g{g}-p{i}" for g in (1, 2) for i in range(4)}
    assert plan.status["replicas"] == 1
    obj = {**obj, "status": plan.status}
    later = desired_state(obj, pods, now=T0 + 5)
    assert sorted(n for _, n in later.deletes) == sorted(f"r1-g{g}-p{i}" for g in (1, 2) for i in range(4))
    obj = {**obj, "status": later.status}
    done = desired_state(obj, [p for p in pods if p["group"] == 0], now=T0 + 6)
    assert [g["index"] for g in done.status["groups"]] == [0]
    assert done.deletes == []  # the DwdpGroup's Services and NetworkPolicy serve the groups that stay


def test_scale_up_adds_groups():
    obj, pods, _ = settle(cr())
    plan = desired_state({**obj, "spec": spec(numGroups=4)}, pods, now=T0)
    assert pod_creates(plan) == [f"r1-g{g}-p{i}" for g in (2, 3) for i in range(4)]


def test_rollout_respects_max_unavailable_highest_first():
    obj, pods, _ = settle(cr(spec(numGroups=3)))
    obj = {**obj, "spec": spec(numGroups=3, image="dwdp:v2")}
    plan = desired_state(obj, pods, now=T0)
    assert [group(plan, g)["phase"] for g in range(3)] == ["Ready", "Ready", "Updating"]
    assert sorted(n for _, n in plan.deletes) == [f"r1-g2-p{i}" for i in range(4)]
    obj = {**obj, "status": plan.status}
    rest = [p for p in pods if p["group"] != 2]
    plan = desired_state(obj, rest, now=T0 + 1)
    new = [m for m in plan.creates if m["kind"] == "Pod"]
    assert {m["spec"]["containers"][0]["image"] for m in new} == {"dwdp:v2"}
    assert group(plan, 2)["attempt"] == 1 and group(plan, 2)["groupRestarts"] == 0
    assert group(plan, 1)["phase"] == "Ready"  # budget 1: group 2 is still unavailable


def test_numgroups_and_restart_policy_do_not_roll():
    obj, pods, _ = settle(cr())
    plan = desired_state({**obj, "spec": spec(restartPolicy={"maxRestarts": 9})}, pods, now=T0)
    assert plan.deletes == [] and pod_creates(plan) == []


def test_invalid_spec_touches_no_child_and_reports():
    bad = cr(spec(gpusPerPod=3))
    plan = desired_state(bad, [], now=T0)
    assert not plan.valid and plan.creates == [] and plan.deletes == [] and plan.patches == []
    inv = next(c for c in plan.status["conditions"] if c["type"] == "Invalid")
    assert inv["status"] == "True" and "gpusPerPod=3" in inv["message"]
    assert [e[1] for e in plan.events] == ["InvalidSpec"]
    again = desired_state({**bad, "status": plan.status}, [], now=T0 + 1)
    assert again.events == []  # one Event per new message


def test_health_lands_in_prefetch_restarts():
    obj, pods, _ = settle(cr())
    health = {p["uid"]: 2 for p in pods if p["group"] == 1}
    plan = desired_state(obj, pods, now=T0, health=health)
    assert group(plan, 1)["prefetchRestarts"] == 8 and group(plan, 0)["prefetchRestarts"] == 0


def test_backoff_math():
    assert [backoff_seconds(n, base=10) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert backoff_seconds(100, base=10) == 300 and backoff_seconds(3, base=0) == 0
    assert exhausted(2, max_restarts=2) and not exhausted(1, max_restarts=2)


def _stuck_group_pods(plan, *, since):
    """Group 1: pods p0-p2 bound to nodes, p3 unschedulable since ``since`` (a clique that lost a node)."""
    pods = pods_from(plan, phase="Pending", ready=False, gang="complete")
    out = []
    for p in pods:
        if p["group"] == 1:
            if p["name"].endswith("p3"):
                p = {**p, "node": "", "unschedulable_since": iso(since)}
            else:
                p = {**p, "node": f"gpu-c2-n{p['name'][-1]}"}
        else:
            p = {**p, "node": f"gpu-c0-n{p['name'][-1]}", "phase": "Running", "ready": True}
        out.append(p)
    return out


def test_placement_dead_end_restarts_the_group_away_from_its_nodes():
    obj = cr(spec(restartPolicy={"maxRestarts": 3, "backoffSeconds": 10, "unschedulableSeconds": 30}))
    first = desired_state(obj, [], now=T0)
    obj = {**obj, "status": first.status}
    pods = _stuck_group_pods(first, since=T0)
    waiting = desired_state(obj, pods, now=T0 + 29)  # not yet a dead end: the scheduler may still place it
    assert group(waiting, 1)["phase"] == "Pending" and not _failure_events(waiting)
    plan = desired_state(obj, pods, now=T0 + 31)
    g1 = group(plan, 1)
    assert g1["phase"] == "Restarting" and g1["lastRestartReason"].startswith("placement dead end: pod r1-g1-p3")
    assert g1["avoidNodes"] == ["gpu-c2-n0", "gpu-c2-n1", "gpu-c2-n2"]
    assert group(plan, 0)["phase"] == "Ready"  # the healthy group is untouched
    obj = {**obj, "status": plan.status}
    others = [p for p in pods if p["group"] != 1]
    due = desired_state(obj, others, now=T0 + 31 + 10)
    new = [m for m in due.creates if m["kind"] == "Pod"]
    assert len(new) == 4
    for m in new:
        terms = m["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchExpressions"][0] == {
            "key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-c2-n0", "gpu-c2-n1", "gpu-c2-n2"]}


def test_unplaceable_group_with_no_pod_bound_is_not_a_dead_end():
    # nothing bound: no clique is pinned, the scheduler (or an autoscaler) may still find room
    obj = cr(spec(restartPolicy={"unschedulableSeconds": 30}))
    first = desired_state(obj, [], now=T0)
    obj = {**obj, "status": first.status}
    pods = [{**p, "node": "", "unschedulable_since": iso(T0)} for p in pods_from(first, phase="Pending", ready=False)]
    plan = desired_state(obj, pods, now=T0 + 3600)
    assert not _failure_events(plan) and all(g["phase"] == "Pending" for g in plan.status["groups"])


def test_requeue_after_is_the_next_time_based_transition():
    obj, pods, _ = settle(cr())
    plan = desired_state(obj, with_(pods, "r1-g1-p0", phase="Failed"), now=T0)
    assert plan.requeue_after == 10  # backoff 10 s: wake then, not every resync
    obj = {**obj, "status": plan.status}
    later = desired_state(obj, [p for p in pods if p["group"] == 0], now=T0 + 4)
    assert later.requeue_after == 6
    shrink = desired_state({**obj, "status": settle(cr())[0]["status"], "spec": spec(numGroups=1)}, pods,
                           now=T0, drain_seconds=5)
    assert shrink.requeue_after == 5  # the drain ends


def test_placement_wait_wakes_when_the_dead_end_matures():
    obj = cr(spec(restartPolicy={"unschedulableSeconds": 30}))
    first = desired_state(obj, [], now=T0)
    plan = desired_state({**obj, "status": first.status}, _stuck_group_pods(first, since=T0), now=T0 + 12)
    assert plan.requeue_after == 18


def test_created_and_scale_up_events():
    first = desired_state(cr(), [], now=T0)
    assert [e.reason for e in first.events] == ["Created"]
    obj, pods, _ = settle(cr())
    up = desired_state({**obj, "spec": spec(numGroups=3)}, pods, now=T0)
    assert [(e.type, e.reason) for e in up.events] == [("Normal", "ScaleUp")] and "group 2" in up.events[0].message


def test_refusals_are_carried_and_summarized():
    from dwdp_operator.status import with_refusals

    obj, pods, plan = settle(cr())
    refused = [{"kind": "ComputeDomain", "reason": "ComputeDomainNotServed", "message": "install the driver"}]
    blocked = with_refusals(plan.status, refused, now=T0)
    assert (blocked["state"], blocked["reason"]) == ("Blocked", "ComputeDomainNotServed")
    cond = next(c for c in blocked["conditions"] if c["type"] == "ChildrenAccepted")
    assert cond["status"] == "False" and cond["message"] == "install the driver"
    assert with_refusals(blocked, refused, now=T0 + 1) is None  # same cause: no new write
    again = desired_state({**obj, "status": blocked}, pods, now=T0 + 2)
    assert again.status["refusals"] == refused and again.status["state"] == "Blocked"  # carried over
    cleared = with_refusals(again.status, [], now=T0 + 3)
    assert cleared["state"] == "Ready" and cleared["refusals"] == []


def test_invalid_state_and_reason():
    plan = desired_state(cr(spec(gpusPerPod=3)), [], now=T0)
    assert (plan.status["state"], plan.status["reason"]) == ("Invalid", "InvalidSpec")
