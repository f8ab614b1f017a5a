"""Fault injection at the operator level, against the real API server (marked k8s, runs in CI).

Every test injects a fault and then checks the same convergence invariant (``converged``):
  * exactly numGroups x podsPerGroup live pods, named ``<name>-g<g>-p<i>``, no duplicate;
  * every group whole and on one attempt (no half group, no mix of attempts), every group Ready;
  * every pod, Service and NetworkPolicy owned by the DwdpGroup's uid (no orphan), and exactly the
    DwdpGroup's own: the client Service, the rank Service and one NetworkPolicy, whatever numGroups;
  * the operator process is still alive (a fault costs a restart of a group, never the operator).
Figures (faults injected, seconds to recover) are printed with ``-s`` and recorded in RELIABILITY.md.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
from kubernetes.client.rest import ApiException

from tests.timing import hold
from .conftest import Operator, group_body, wait_for, wait_seen

PER = 4  # pods per group in group_body (dwdpSize 4, gpusPerPod 1)
FAULTS_DIR = Path(__file__).parent / "faultinject"


def converged(c, ns: str, name: str, n: int, *, timeout: float = 60.0, attempts: list[int] | None = None,
              operator: Operator | None = None) -> dict:
    """Wait until DwdpGroup ``name`` is whole (see module docstring), then return its status; on a timeout,
    say what was last seen and end with the log of ``operator`` (default: the cluster's)."""
    def check():
        st = c.get_group(ns, name).get("status") or {}
        pods = c.live_pods(ns, f"dwdp.io/name={name}")
        if st.get("readyGroups") != n or len(st.get("groups") or []) != n or len(pods) != n * PER:
            return None
        return st
    st = wait_seen(c, ns, name, check, timeout=timeout, what=f"{name}: {n} whole ready groups", operator=operator)
    uid = c.get_group(ns, name)["metadata"]["uid"]
    pods = c.pods(ns, f"dwdp.io/name={name}")
    names = sorted(p.metadata.name for p in pods)
    assert names == sorted(f"{name}-g{g}-p{i}" for g in range(n) for i in range(PER)), f"duplicates/extras: {names}"
    for g in range(n):
        att = {p.metadata.labels["dwdp.io/attempt"] for p in pods if p.metadata.labels["dwdp.io/group"] == str(g)}
        assert att == {str(st["groups"][g]["attempt"])}, f"group {g}: pods on attempts {att}, status says " \
                                                          f"{st['groups'][g]['attempt']} (half group)"
    for p in pods:
        assert [o.uid for o in p.metadata.owner_references] == [uid], f"orphan pod {p.metadata.name}"
    svcs = {s.metadata.name: s for s in c.core.list_namespaced_service(ns).items
            if (s.metadata.labels or {}).get("dwdp.io/name") == name}
    nps = {x.metadata.name: x for x in c.net.list_namespaced_network_policy(ns).items
           if (x.metadata.labels or {}).get("dwdp.io/name") == name}
    assert sorted(svcs) == [name, f"{name}-ranks"], sorted(svcs)
    assert sorted(nps) == [name], sorted(nps)
    for o in [*svcs.values(), *nps.values()]:
        assert [r.uid for r in o.metadata.owner_references] == [uid], f"orphan {o.kind} {o.metadata.name}"
    if attempts is not None:
        assert [g["attempt"] for g in st["groups"]] == attempts, st["groups"]
    return st


def _alive(op: Operator) -> None:
    assert op.proc is not None and op.proc.poll() is None, f"operator died:\n{op.log()[-3000:]}"


def _ready_pods(c, ns, name, g) -> int:
    return sum(1 for p in c.live_pods(ns, f"dwdp.io/name={name},dwdp.io/group={g}")
               if p.status.phase == "Running")


def test_pod_killed_during_rendezvous_and_during_serving(cluster, ns):
    c = cluster
    # rendezvous: ranks 0-2 up and waiting for rank 3 (held Pending by the kubelet); rank 1 dies
    c.kubelet.hold(ns, "rv-g0-p3")
    c.create_group(ns, group_body("rv", numGroups=1))
    wait_for(lambda: _ready_pods(c, ns, "rv", 0) == 3, timeout=30, what="3 of 4 ranks up")
    # the operator writes the status after the kubelet may have started the 3 pods: wait for it, then check
    groups = wait_for(lambda: (c.get_group(ns, "rv").get("status") or {}).get("groups"), timeout=10,
                      what="the group's status")
    assert groups[0]["phase"] == "Pending", groups
    t0 = time.time()
    c.core.delete_namespaced_pod("rv-g0-p1", ns, grace_period_seconds=0)
    wait_for(lambda: {p.metadata.labels["dwdp.io/attempt"] for p in c.pods(ns)} == {"1"}
             and len(c.live_pods(ns)) == PER, timeout=30, what="attempt 1 created whole")
    c.kubelet.release(ns, "rv-g0-p3")
    st = converged(c, ns, "rv", 1, attempts=[1])
    t_rdv = time.time() - t0
    assert st["groups"][0]["groupRestarts"] == 1
    # serving: a Ready group loses a pod
    t0 = time.time()
    c.core.delete_namespaced_pod("rv-g0-p2", ns, grace_period_seconds=0)
    st = converged(c, ns, "rv", 1, attempts=[2])
    t_srv = time.time() - t0
    assert st["groups"][0]["groupRestarts"] == 2
    assert [h["attempt"] for h in st["groups"][0]["history"]] == [0, 1]
    _alive(c.operator)
    print(f"\nFIGURE pod-kill: rendezvous recovered in {t_rdv:.1f}s (incl. backoff 1s), serving in {t_srv:.1f}s")


def test_node_deleted_group_moves_to_a_whole_clique(cluster, ns):
    from .kubelet import make_nodes
    c = cluster
    # unschedulableSeconds short: if the scheduler puts the new attempt's first pod in the clique that
    # lost the node (3 nodes left for 4 pods), the operator must notice the dead end and move the group
    c.create_group(ns, group_body("nd", numGroups=2,
                                  restartPolicy={"maxRestarts": 5, "backoffSeconds": 1, "unschedulableSeconds": 3}))
    st0 = converged(c, ns, "nd", 2)
    # the first placement may already hit a dead end (with 3 s allowed, a pod the scheduler retries late on a
    # loaded machine counts as stuck — seen once in CI): allowed, named as such; what follows counts from here
    for g in st0["groups"]:
        assert all(h["reason"].startswith("placement dead end") for h in g.get("history") or []), g["history"]
    attempt0 = [g["attempt"] for g in st0["groups"]]
    history0 = [len(g.get("history") or []) for g in st0["groups"]]
    victim = c.core.read_namespaced_pod("nd-g1-p2", ns)
    node = victim.spec.node_name
    g0_before = c.live_pods(ns, "dwdp.io/group=0")
    g0_hit = node in {p.spec.node_name for p in g0_before}
    t0 = time.time()
    c.core.delete_node(node)
    try:
        # kube-controller-manager's pod GC deletes pods bound to a deleted node after a 40 s
        # quarantine; do its job at once (grace 0, as podgc does) to keep the suite fast
        for p in c.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items:
            c.core.delete_namespaced_pod(p.metadata.name, p.metadata.namespace, grace_period_seconds=0)
        st = converged(c, ns, "nd", 2)
        t = time.time() - t0
        if not g0_hit:  # group 0 had no pod on the lost node: untouched
            assert {p.metadata.uid for p in c.live_pods(ns, "dwdp.io/group=0")} == \
                {p.metadata.uid for p in g0_before}
            assert st["groups"][0]["attempt"] == attempt0[0]
        g1 = c.live_pods(ns, "dwdp.io/group=1")
        assert node not in {p.spec.node_name for p in g1}
        cliques = {c.core.read_node(p.spec.node_name).metadata.labels["nvidia.com/gpu.clique"] for p in g1}
        assert len(cliques) == 1 and len({p.spec.node_name for p in g1}) == PER
        hist = [h["reason"] for h in st["groups"][1]["history"]][history0[1]:]
        assert hist and ("deleted" in hist[0] or "disappeared" in hist[0]), hist  # the node loss: one restart
        # then possibly placement dead ends, each named as such: one in the damaged clique, and on a loaded
        # machine a retried pod that waits past the 3 s allowed counts as one more (maxRestarts leaves room)
        assert st["groups"][1]["attempt"] == attempt0[1] + len(hist), hist
        assert all(h.startswith("placement dead end") for h in hist[1:]), hist
        _alive(c.operator)
        print(f"\nFIGURE node-delete: group(s) re-placed on a whole clique in {t:.1f}s (group 0 hit: {g0_hit}; "
              f"placement dead ends: {len(hist) - 1})")
    finally:
        make_nodes(c.core)  # give the node back to the other tests


def test_api_faults_and_conflicting_writers_during_reconcile(cluster, ns, tmp_path):
    """The operator's writes fail at random (409/500/429, 25 %, seeded) while the test patches the
    same DwdpGroup concurrently; create, a pod kill and a scale-up must still converge exactly."""
    c = cluster
    log = tmp_path / "faults.log"
    env = dict(c.operator.env, DWDP_TEST_FAULTS=f"7:0.25:{log}",
               PYTHONPATH=os.pathsep.join([str(FAULTS_DIR), c.operator.env.get("PYTHONPATH", "")]))
    faulty = Operator(env, tmp_path)
    faulty.cmd = list(c.operator.cmd)
    c.operator.stop()
    faulty.start()
    stop = threading.Event()
    conflicts = [0]

    def other_writer():  # a second client writing the same object: resourceVersion churn + real 409s
        i = 0
        while not stop.is_set():
            i += 1
            try:
                obj = c.get_group(ns, "fz")
                obj["metadata"].setdefault("annotations", {})["test/touch"] = str(i)
                time.sleep(0.01)
                c.custom.replace_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", "fz", obj)
            except ApiException as e:
                conflicts[0] += e.status == 409
            time.sleep(0.02)
    writer = threading.Thread(target=other_writer, daemon=True)
    try:
        c.create_group(ns, group_body("fz", numGroups=3))
        writer.start()
        t0 = time.time()
        converged(c, ns, "fz", 3, attempts=[0, 0, 0], operator=faulty)
        t_create = time.time() - t0
        t0 = time.time()
        c.core.delete_namespaced_pod("fz-g1-p0", ns, grace_period_seconds=0)
        wait_for(lambda: c.get_group(ns, "fz")["status"]["groups"][1]["attempt"] == 1, timeout=30,
                 what="group 1 restarted")
        c.patch_spec(ns, "fz", {"numGroups": 4})
        st = converged(c, ns, "fz", 4, attempts=[0, 1, 0, 0], operator=faulty)
        t_more = time.time() - t0
        assert [g["groupRestarts"] for g in st["groups"]] == [0, 1, 0, 0], "faults cost no extra restart"
        _alive(faulty)
    finally:
        stop.set()
        faulty.stop()
        c.operator.start()
    injected = log.read_text().splitlines() if log.exists() else []
    assert len(injected) >= 10, f"only {len(injected)} faults injected: the hook is not active"
    kinds = {line.split()[0] for line in injected}
    assert kinds == {"409", "500", "429"}, kinds
    print(f"\nFIGURE api-faults: {len(injected)} injected write faults (409/500/429), "
          f"{conflicts[0]} real 409s to a concurrent writer; create converged in {t_create:.1f}s, "
          f"restart+scale-up in {t_more:.1f}s")


#: a placement dead end's wait in the server-restart test: pods the test scheduler placed just before the restart
#: (kube-scheduler is restarted with the server: scripts/test-cluster says why) can still split a group across a clique
#: (seen here, 2026-12-08: 2 of 6 groups half bound in clique c0); the operator's own way out is the restart away
#: from those nodes, after this many seconds instead of the default 300
DEAD_END_S = 10


def _restarted_only_for_placement(st: dict) -> list[int]:
    """The groups restarted (attempt 1); every restart must be the placement dead end's, never the server's."""
    moved = [g["index"] for g in st["groups"] if g["attempt"]]
    for g in st["groups"]:
        reasons = [h["reason"] for h in g.get("history") or []]
        assert g["attempt"] <= 1 and all(r.startswith("placement dead end") for r in reasons), g
    return moved


def test_apiserver_restart_mid_reconcile(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("as", numGroups=6, restartPolicy={"maxRestarts": 3, "backoffSeconds": 1,
                                                                    "unschedulableSeconds": DEAD_END_S}))
    wait_for(lambda: len(c.pods(ns)) >= 4, timeout=30, interval=0.005, what="first pods")
    n_at = len(c.pods(ns))
    t0 = time.time()
    down = c.restart_apiserver()
    st = converged(c, ns, "as", 6, timeout=90 + DEAD_END_S)
    t = time.time() - t0
    moved = _restarted_only_for_placement(st)
    # and once more while serving: nothing may restart
    uids = {p.metadata.uid for p in c.live_pods(ns)}
    c.restart_apiserver()
    # the server answers 404 for custom resources until its CRD handlers sync: the operator must
    # live through that window (kopf's watcher treats the 404 as fatal; cli.py restarts kopf)
    deadline = time.time() + 8
    while time.time() < deadline:
        _alive(c.operator)
        time.sleep(0.2)
    converged(c, ns, "as", 6, timeout=60, attempts=[g["attempt"] for g in st["groups"]])
    assert {p.metadata.uid for p in c.live_pods(ns)} == uids, "a server restart restarted pods"
    _alive(c.operator)
    print(f"\nFIGURE apiserver-restart: killed at {n_at}/24 pods, server away {down:.1f}s, "
          f"converged {t:.1f}s after the kill; groups moved out of a placement dead end: {moved}")


def test_operator_started_during_an_apiserver_restart(cluster, ns):
    """An operator (kopf) started while the API server restarts, then again at each of its restarts, must
    not come up blind: a kopf whose discovery ran while the restarted server did not list DwdpGroups yet
    never watches them (served.py). Afterwards a scale-up must converge."""
    c = cluster
    c.create_group(ns, group_body("os", numGroups=1))
    converged(c, ns, "os", 1, attempts=[0])
    c.operator.stop()
    restart = threading.Thread(target=c.restart_apiserver)
    restart.start()
    # the server is down: the operator's first starts fail and back off, into the window
    hold(0.3, "the operator starts while the API server is down")
    c.operator.start()
    restart.join(120)
    c.patch_spec(ns, "os", {"numGroups": 2})
    converged(c, ns, "os", 2, timeout=60, attempts=[0, 0])
    _alive(c.operator)


@pytest.mark.parametrize("seed", range(10))
def test_operator_killed_at_random_point_of_scale_up(cluster, ns, seed):
    """Seeded: SIGKILL the operator after a random delay into a 1 -> 3 scale-up (sometimes twice),
    restart it; exactly 12 pods, one attempt per group, no orphan, no restart counted."""
    c = cluster
    rng = random.Random(seed)
    name = f"k{seed}"
    c.create_group(ns, group_body(name, numGroups=1))
    converged(c, ns, name, 1, attempts=[0])
    _alive(c.operator)  # never hide a dead operator behind the kill/start below
    c.patch_spec(ns, name, {"numGroups": 3})
    kills = []
    for _ in range(1 + (rng.random() < 0.3)):
        # most kills inside the creation burst (~0.1 s), the rest during gang lift / readiness
        delay = rng.uniform(0.0, 0.12) if rng.random() < 0.6 else rng.uniform(0.12, 1.0)
        time.sleep(delay)
        kills.append((round(delay, 2), len(c.pods(ns))))
        c.operator.kill()
        c.operator.start()
    t0 = time.time()
    st = converged(c, ns, name, 3, attempts=[0, 0, 0])
    assert [g["groupRestarts"] for g in st["groups"]] == [0, 0, 0]
    _alive(c.operator)
    print(f"\nFIGURE kill-seed-{seed}: kills at (delay s, pods) {kills}; converged {time.time() - t0:.1f}s after restart")
