"""``spec.failurePolicy: Degrade`` against the real API server (issue #30).

A group of dwdpSize 4, one rank per pod, experts.replicas 2 (every expert on two ranks: its owner and the owner's
ring successor):
  * one failed pod is recreated alone — same name, same attempt label, a new uid; the other three pods keep their
    uids — while the DwdpGroup reads Degraded (status.state, condition Degraded with the rank and why,
    status.groups[0].lostPods / missingRanks / coverage, ``kubectl get`` and ``kubectl describe``, Event RankLost),
    then Ready once the replacement is Ready (condition Degraded False, Event RankRejoined);
  * a second loss that leaves experts without a surviving holder (two ring neighbours) restarts the whole group at
    attempt+1, the reason in status and in the GroupRestart Event;
  * a deleted pod is absorbed like a failed one, until spec.degrade's budget is spent: the next loss restarts the
    group, and the reason names the budget.
RestartGroup (the default) restarting the whole group is test_k8s_operator.py's
``test_killed_pod_recreates_whole_group_with_next_attempt`` and ``test_failed_pod_phase_restarts_group``.

The test kubelet makes a bound pod Running and Ready at once, so a Degraded group would heal before a test could
look at it: ``Kubelet.hold`` keeps the replacement Pending until the test has read the Degraded state.
"""

from __future__ import annotations

import time

from dwdp_operator.apply import POD_REMEMBER_S

from tests.timing import hold
from .conftest import group_body, wait_for

NAME = "dg"
PODS = [f"{NAME}-g0-p{i}" for i in range(4)]
# every wait below is one operator pass (a pod event) plus the test kubelet's reaction, or one restart backoff (1 s):
# seconds normally; generous for a loaded 2-core CI machine
WAIT_S = 30
# r = 2 with k = s = 4 over 16 experts: rank j holds [4j, 4j+4) and its ring predecessor's range; losing rank 2
# leaves experts 8-11 on rank 3 only (coverage 1), losing ranks 1 and 2 leaves experts 4-7 on no rank
EXPERTS = {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4, "replicas": 2}


def degrade_body(**over) -> dict:
    return group_body(NAME, numGroups=1, failurePolicy="Degrade", experts=EXPERTS, **over)


def status(c, ns) -> dict:
    return c.get_group(ns, NAME).get("status") or {}


def pod_uids(c, ns) -> dict[str, str]:
    return {p.metadata.name: p.metadata.uid for p in c.live_pods(ns)}


def attempt_labels(c, ns) -> set[str]:
    return {p.metadata.labels["dwdp.io/attempt"] for p in c.live_pods(ns)}


def conditions(st: dict) -> dict[str, dict]:
    return {x["type"]: x for x in st.get("conditions") or []}


def wait_ready(c, ns, *, attempt: int, what: str) -> dict:
    """The DwdpGroup Ready with its four pods live at ``attempt``: the status then."""
    def check():
        st = status(c, ns)
        whole = len(c.live_pods(ns)) == 4 and attempt_labels(c, ns) == {str(attempt)}
        g = (st.get("groups") or [{}])[0]
        return st if whole and st.get("state") == "Ready" and g.get("attempt") == attempt else None
    return wait_for(check, timeout=WAIT_S, what=what)


def get_columns(c, ns, *extra: str) -> list[str]:
    """``kubectl get dwdp`` split into words: the header first, then the object's row."""
    return c.kubectl("get", "dwdp", NAME, "-n", ns, *extra).stdout.split()


def event_messages(c, ns, reason: str) -> list[str]:
    return [e.message for e in c.events(ns, reason) if e.involved_object.name == NAME]


def test_degrade_recreates_only_the_failed_pod_shows_degraded_then_ready(cluster, ns):
    c = cluster
    c.create_group(ns, degrade_body())
    wait_ready(c, ns, attempt=0, what="the group Ready")  # every pod was created before this
    # a pod that has served a while, as in life: one lost within POD_REMEMBER_S of its creation waits for the
    # operator's create memory to end (apply.py; the last test takes that path)
    hold(POD_REMEMBER_S, "the pod serves past the operator's create memory")
    before = pod_uids(c, ns)
    lost = PODS[2]
    lost_env = c.core.read_namespaced_pod(lost, ns).spec.containers[0].env
    c.kubelet.hold(ns, lost)  # the replacement stays Pending: the group stays Degraded while the test reads it
    try:
        t_fail = time.time()
        c.kubelet.fail(ns, lost)
        wait_for(lambda: pod_uids(c, ns).get(lost) not in (None, before[lost]) and status(c, ns)["state"] == "Degraded",
                 timeout=WAIT_S, what=f"{lost} recreated and the DwdpGroup Degraded")
        t_degraded = time.time() - t_fail
        st = status(c, ns)
        after = pod_uids(c, ns)
        replacement = c.core.read_namespaced_pod(lost, ns)

        # only the failed pod was recreated: same name, same attempt, new uid; the others untouched
        assert {n: u for n, u in after.items() if n != lost} == {n: u for n, u in before.items() if n != lost}
        assert replacement.metadata.labels["dwdp.io/attempt"] == "0" and replacement.status.phase == "Pending"
        assert replacement.metadata.labels["dwdp.io/gang"] == "complete" and not replacement.spec.scheduling_gates
        assert replacement.spec.containers[0].env == lost_env  # the same rank of the same attempt: it rejoins
        env = {e.name: e.value for e in lost_env}
        assert env["DWDP_ATTEMPT"] == "0" and env["DWDP_RANK_BASE"] == "2"
        # an elastic group: where every pod answers, for the survivors' store failover (contract.ElasticEnv)
        assert env["DWDP_POD_ADDR_TEMPLATE"] == f"{NAME}-g0-p{{pod}}.{NAME}-ranks.{ns}.svc"
        assert env["DWDP_POD_ADDR_TEMPLATE"].replace("{pod}", "2") == \
            f"{replacement.spec.hostname}.{replacement.spec.subdomain}.{ns}.svc"

        # the status the operator writes while the group serves without rank 2
        assert (st["state"], st["reason"]) == ("Degraded", "RanksMissing")
        assert (st["readyGroups"], st["degradedGroups"], st["readyRanks"], st["totalRestarts"]) == (0, 1, 3, 0)
        g = st["groups"][0]
        assert (g["phase"], g["attempt"], g["groupRestarts"]) == ("Degraded", 0, 0)
        assert g["missingRanks"] == [2] and g["coverage"] == 1 and len(g["podRecreations"]) == 1
        assert [(lp["pod"], lp["ranks"], lp["uid"], lp["reason"]) for lp in g["lostPods"]] == \
            [(2, [2], before[lost], f"pod {lost} Failed")]
        cond = conditions(st)
        assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "RanksMissing")
        why = cond["Degraded"]["message"]
        assert "without ranks [2]" in why and f"pod {lost} Failed" in why and "coverage 1" in why
        assert cond["Ready"]["status"] == "False" and "1 degraded" in cond["Ready"]["message"]

        # what a person sees
        out = get_columns(c, ns)
        assert out[:7] == ["NAME", "GROUPS", "READY", "RESTARTS", "STATUS", "REASON", "AGE"]
        assert out[7:13] == [NAME, "1", "0", "0", "Degraded", "RanksMissing"]
        wide = get_columns(c, ns, "-o", "wide")
        assert wide[7] == "READYRANKS" and wide[-5] == "3"
        lost_msg = wait_for(lambda: event_messages(c, ns, "RankLost"), timeout=WAIT_S, what="a RankLost Event")
        assert len(lost_msg) == 1 and f"pod {lost} (rank(s) [2]) lost (pod {lost} Failed)" in lost_msg[0]
        assert "recreating only that pod at attempt 0" in lost_msg[0] and "coverage left 1" in lost_msg[0]
        described = c.kubectl("describe", "dwdp", NAME, "-n", ns).stdout
        assert "RanksMissing" in described and "without ranks [2]" in described and f"pod {lost} Failed" in described
        assert "RankLost" in described  # the Event, listed under the object
    finally:
        t_release = time.time()
        c.kubelet.release(ns, lost)

    st = wait_ready(c, ns, attempt=0, what="the replacement Ready and the DwdpGroup Ready again")
    t_ready = time.time() - t_release
    g = st["groups"][0]
    assert g["phase"] == "Ready" and g["groupRestarts"] == 0 and len(g["podRecreations"]) == 1
    assert not {"lostPods", "missingRanks", "coverage"} & set(g)
    cond = conditions(st)
    assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("False", "Healthy")
    assert (st["readyGroups"], st["degradedGroups"], st["readyRanks"], st["totalRestarts"]) == (1, 0, 4, 0)
    final = pod_uids(c, ns)
    assert {n: u for n, u in final.items() if n != lost} == {n: u for n, u in before.items() if n != lost}
    assert final[lost] == after[lost], "the replacement itself serves: not recreated again"
    rejoined = wait_for(lambda: (m := event_messages(c, ns, "RankRejoined")) and len(m) == 2 and m,
                        timeout=WAIT_S, what="RankRejoined Events")
    assert any(f"pod {lost} (rank(s) [2]) Ready again" in m and "at attempt 0" in m for m in rejoined)
    assert any("every lost pod rejoined" in m for m in rejoined)
    assert not event_messages(c, ns, "GroupRestart")
    assert get_columns(c, ns)[7:13] == [NAME, "1", "1", "0", "Ready", "AllGroupsReady"]
    print(f"\nFIGURE degrade: pod failed -> replacement created, DwdpGroup Degraded in {t_degraded:.1f}s; "
          f"replacement Running -> DwdpGroup Ready in {t_ready:.1f}s; 3 of 4 pods never touched")


def test_degrade_losing_coverage_restarts_the_whole_group_and_says_why(cluster, ns):
    c = cluster
    c.create_group(ns, degrade_body())
    wait_ready(c, ns, attempt=0, what="the group Ready")
    first, second = PODS[1], PODS[2]  # ring neighbours: with r = 2 experts 4-7 live only on ranks 1 and 2
    c.kubelet.hold(ns, first)  # rank 1 stays lost (its replacement Pending) when rank 2 fails
    try:
        c.kubelet.fail(ns, first)
        wait_for(lambda: [lp["pod"] for lp in status(c, ns)["groups"][0].get("lostPods") or []] == [1],
                 timeout=WAIT_S, what=f"{first} lost, absorbed")
        c.kubelet.fail(ns, second)
        g = wait_for(lambda: (x := status(c, ns)["groups"][0])["groupRestarts"] == 1 and x,
                     timeout=WAIT_S, what="a group restart")
    finally:
        c.kubelet.release(ns, first)
    why = "failurePolicy Degrade falls back to a group restart: coverage lost: without ranks 1-2 experts 4-7 have " \
          "no surviving holder (experts.replicas=2)"
    assert why in g["lastRestartReason"] and f"pod {second} Failed" in g["lastRestartReason"]
    assert not {"lostPods", "missingRanks", "coverage", "podRecreations"} & set(g)
    st = wait_ready(c, ns, attempt=1, what="the group Ready at attempt 1")
    assert st["groups"][0]["groupRestarts"] == 1 and st["totalRestarts"] == 1
    assert [h["attempt"] for h in st["groups"][0]["history"]] == [0]
    restart = wait_for(lambda: event_messages(c, ns, "GroupRestart"), timeout=WAIT_S, what="a GroupRestart Event")
    assert len(restart) == 1 and why in restart[0]
    assert len(event_messages(c, ns, "RankLost")) == 1  # rank 1's loss only; rank 2's became the restart


def test_degrade_absorbs_a_deleted_pod_until_the_budget_is_spent(cluster, ns):
    c = cluster
    created = time.time()
    c.create_group(ns, degrade_body(degrade={"maxPodRecreations": 1}))
    wait_ready(c, ns, attempt=0, what="the group Ready")
    before = pod_uids(c, ns)
    t_delete = time.time()
    c.core.delete_namespaced_pod(PODS[0], ns)  # rank 0: the store host is a pod like any other to the operator

    def healed():
        st, now = status(c, ns), pod_uids(c, ns)
        g = (st.get("groups") or [{}])[0]
        if (st.get("state") == "Ready" and len(g.get("podRecreations") or []) == 1
                and now.get(PODS[0]) not in (None, before[PODS[0]])):
            return st
        # wait_for shows the last exception: what was still missing, should the wait time out
        raise AssertionError(f"state {st.get('state')}, podRecreations {g.get('podRecreations')}, attempt "
                             f"{g.get('attempt')}, groupRestarts {g.get('groupRestarts')} "
                             f"({g.get('lastRestartReason')}), "
                             f"{PODS[0]} {'replaced' if now.get(PODS[0]) not in (None, before[PODS[0]]) else 'not replaced'}"
                             f", live pods {sorted(now)}, conditions {[(k, v.get('status'), v.get('reason')) for k, v in conditions(st).items()]}")
    st = wait_for(healed, timeout=WAIT_S, what=f"{PODS[0]} recreated alone and the group Ready")
    t_healed = time.time() - t_delete
    now = pod_uids(c, ns)
    assert {n: now[n] for n in PODS[1:]} == {n: before[n] for n in PODS[1:]}
    assert attempt_labels(c, ns) == {"0"} and st["groups"][0]["groupRestarts"] == 0
    lost_msg = wait_for(lambda: event_messages(c, ns, "RankLost"), timeout=WAIT_S, what="a RankLost Event")
    assert f"pod {PODS[0]} (rank(s) [0]) lost" in lost_msg[0] and "recreation 1/1 within 600s" in lost_msg[0]

    c.core.delete_namespaced_pod(PODS[3], ns)
    g = wait_for(lambda: (x := status(c, ns)["groups"][0])["groupRestarts"] == 1 and x, timeout=WAIT_S,
                 what="a group restart once the budget is spent")
    assert "failurePolicy Degrade falls back to a group restart: recreation budget spent: 1 pod(s) recreated alone " \
           "within the last 600s, 1 more would pass degrade.maxPodRecreations=1" in g["lastRestartReason"]
    assert PODS[3] in g["lastRestartReason"]
    st = wait_ready(c, ns, attempt=1, what="the group Ready at attempt 1")
    assert "podRecreations" not in st["groups"][0], "a new attempt starts with a fresh budget"
    assert len(event_messages(c, ns, "RankLost")) == 1
    print(f"\nFIGURE degrade-budget: a pod deleted {t_delete - created:.1f}s after its group's creation replaced "
          f"alone, group Ready in {t_healed:.1f}s (inside the {POD_REMEMBER_S:g}s create memory); the next loss "
          f"restarted the group")
