"""The operator against a real kube-apiserver + etcd + controller-manager + scheduler (marked k8s)."""

from __future__ import annotations

import time

from dwdp_runtime.contract import POD_ENV
from kubernetes.client.rest import ApiException

from tests.timing import hold
from .conftest import group_body, wait_for, wait_seen

CONTRACT_ENV = [v.value for v in POD_ENV]  # dwdp_runtime.contract, pinned to docs/ENV_CONTRACT.md


def ready_groups(c, ns, name, n):
    def check():
        st = c.get_group(ns, name).get("status") or {}
        return st if st.get("readyGroups") == n and len(c.live_pods(ns)) == n * 4 else None
    return wait_seen(c, ns, name, check, timeout=60, what=f"{n} ready groups")


def attempts(c, ns, g):
    return {p.metadata.labels["dwdp.io/attempt"] for p in c.live_pods(ns, f"dwdp.io/group={g}")}


def test_create_schedules_each_group_in_one_clique(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=3))
    st = ready_groups(c, ns, "r1", 3)
    nodes = {n.metadata.name: n.metadata.labels for n in c.core.list_node().items}
    pods = c.live_pods(ns)
    assert sorted(p.metadata.name for p in pods) == sorted(f"r1-g{g}-p{i}" for g in range(3) for i in range(4))
    for g in range(3):
        gp = [p for p in pods if p.metadata.labels["dwdp.io/group"] == str(g)]
        cliques = {nodes[p.spec.node_name]["nvidia.com/gpu.clique"] for p in gp}
        assert len(cliques) == 1, f"group {g} spans cliques {cliques}"
        assert len({p.spec.node_name for p in gp}) == 4, "one pod of a group per node"
    p = next(p for p in pods if p.metadata.name == "r1-g1-p2")
    env = {e.name: e for e in p.spec.containers[0].env}
    assert [e.name for e in p.spec.containers[0].env] == CONTRACT_ENV
    assert env["DWDP_STORE_ADDR"].value == f"r1-g1-p0.r1-ranks.{ns}.svc" and env["DWDP_RANK_BASE"].value == "2"
    assert env["DWDP_TOKEN"].value_from.secret_key_ref.name == "r1-token"
    assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
    assert p.metadata.owner_references[0].kind == "DwdpGroup" and p.metadata.owner_references[0].controller
    assert p.spec.containers[0].startup_probe.http_get.path == "/healthz"
    assert p.spec.containers[0].readiness_probe.http_get.path == "/readyz"
    assert p.metadata.labels["dwdp.io/gang"] == "complete"
    hs = c.core.read_namespaced_service("r1-ranks", ns)  # one headless Service for every group's ranks
    assert hs.spec.cluster_ip == "None" and hs.spec.publish_not_ready_addresses
    assert p.spec.subdomain == "r1-ranks" and p.spec.hostname == p.metadata.name
    assert c.core.read_namespaced_service("r1", ns).spec.selector == {"dwdp.io/name": "r1", "dwdp.io/serving": "true"}
    assert c.core.read_namespaced_secret("r1-token", ns).data["token"]
    token = c.core.read_namespaced_secret("r1-token", ns).data["token"]  # base64 of the token
    import base64
    assert base64.b64decode(token).decode() not in str(c.core.read_namespaced_pod("r1-g1-p2", ns).to_dict())
    sc = p.spec.containers[0].security_context  # stored by the server as the operator wrote it
    assert sc.run_as_non_root and sc.read_only_root_filesystem and sc.capabilities.drop == ["ALL"]
    assert not sc.allow_privilege_escalation and p.spec.security_context.run_as_user == 10001
    np = c.net.read_namespaced_network_policy("r1", ns)
    own = {"dwdp.io/name": "r1", "app.kubernetes.io/component": "worker"}
    assert np.spec.pod_selector.match_labels == own and np.spec.policy_types == ["Ingress"]
    assert [x.port for x in np.spec.ingress[0].ports] == [29500]
    assert np.spec.ingress[0]._from[0].pod_selector.match_labels == own
    assert [x.port for x in np.spec.ingress[1].ports] == [8000] and not np.spec.ingress[1]._from
    assert c.custom.get_namespaced_custom_object("resource.nvidia.com", "v1beta1", ns, "computedomains", "r1-imex")
    assert st["selector"] == "dwdp.io/name=r1" and st["replicas"] == 3
    conds = {x["type"]: x["status"] for x in st["conditions"]}
    assert conds == {"Ready": "True", "Progressing": "False", "Degraded": "False", "Invalid": "False",
                     "ChildrenAccepted": "True"}
    assert (st["state"], st["reason"]) == ("Ready", "AllGroupsReady")
    out = c.kubectl("get", "dwdp", "r1", "-n", ns).stdout.split()
    assert out[:7] == ["NAME", "GROUPS", "READY", "RESTARTS", "STATUS", "REASON", "AGE"]
    assert out[7:13] == ["r1", "3", "3", "0", "Ready", "AllGroupsReady"]
    wide = c.kubectl("get", "dwdp", "r1", "-n", ns, "-o", "wide").stdout.split()
    assert wide[7:12] == ["READYRANKS", "DWDPSIZE", "EXPERTS/WORKER", "TRANSFER", "IMAGE"]
    assert wide[-5:] == ["12", "4", "4", "copy_engine", "dwdp:test"]  # 3 ready groups x 4 ranks


def test_killed_pod_recreates_whole_group_with_next_attempt(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1"))
    ready_groups(c, ns, "r1", 2)
    uids_g0 = {p.metadata.uid for p in c.live_pods(ns, "dwdp.io/group=0")}
    c.core.delete_namespaced_pod("r1-g1-p2", ns)
    wait_for(lambda: attempts(c, ns, 1) == {"1"} and len(c.live_pods(ns, "dwdp.io/group=1")) == 4,
             timeout=30, what="group 1 at attempt 1")
    st = ready_groups(c, ns, "r1", 2)
    g1 = st["groups"][1]
    assert g1["attempt"] == 1 and g1["groupRestarts"] == 1 and "r1-g1-p2" in g1["lastRestartReason"]
    assert {p.metadata.uid for p in c.live_pods(ns, "dwdp.io/group=0")} == uids_g0, "group 0 untouched"
    env = {e.name: e.value for e in c.core.read_namespaced_pod("r1-g1-p0", ns).spec.containers[0].env}
    assert env["DWDP_ATTEMPT"] == "1"
    assert wait_for(lambda: c.events(ns, "GroupRestart"), what="GroupRestart event")


def test_restart_storm_backs_off_then_fails(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=1, restartPolicy={"maxRestarts": 2, "backoffSeconds": 1}))
    ready_groups(c, ns, "r1", 1)
    seen = []
    for attempt in range(3):
        wait_for(lambda: attempts(c, ns, 0) == {str(attempt)} and c.get_group(ns, "r1")["status"]["readyGroups"] == 1,
                 timeout=30, what=f"attempt {attempt} ready")
        c.kubelet.bump_restart(ns, "r1-g0-p1")
        seen.append(time.time())
    failed = wait_for(lambda: (g := c.get_group(ns, "r1")["status"]["groups"][0])["phase"] == "Failed" and g,
                      timeout=30, what="group Failed")
    assert failed["groupRestarts"] == 2 and len(failed["history"]) == 3
    assert [h["attempt"] for h in failed["history"]] == [0, 1, 2]
    # restart 1 waited >= 1 s, restart 2 >= 2 s (exponential)
    assert seen[1] - seen[0] >= 1.0 and seen[2] - seen[1] >= 2.0
    deg = c.condition(ns, "r1", "Degraded")
    assert deg["status"] == "True" and "Failed" in deg["message"]
    assert wait_for(lambda: c.events(ns, "GroupFailed"), what="GroupFailed event")
    wait_for(lambda: not c.pods(ns), timeout=30, what="failed group's pods deleted")
    hold(2, "a window in which a Failed group must not come back")
    assert not c.pods(ns), "a Failed group is not recreated"


def test_failed_pod_phase_restarts_group(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=1))
    ready_groups(c, ns, "r1", 1)
    c.kubelet.fail(ns, "r1-g0-p3")
    wait_for(lambda: attempts(c, ns, 0) == {"1"} and len(c.live_pods(ns)) == 4, timeout=30, what="attempt 1")
    assert "Failed" in c.get_group(ns, "r1")["status"]["groups"][0]["lastRestartReason"]


def test_kubectl_scale_up_and_down(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=1))
    ready_groups(c, ns, "r1", 1)
    c.kubectl("scale", "dwdpgroup/r1", "-n", ns, "--replicas=3")
    ready_groups(c, ns, "r1", 3)
    c.kubectl("scale", "dwdpgroup/r1", "-n", ns, "--replicas=1")
    wait_for(lambda: {p.metadata.labels["dwdp.io/group"] for p in c.pods(ns)} == {"0"}, timeout=30,
             what="groups 1 and 2 removed")
    st = wait_for(lambda: (s := c.get_group(ns, "r1")["status"]) and len(s["groups"]) == 1 and s, timeout=30,
                  what="status shrinks")
    assert st["replicas"] == 1 and st["groups"][0]["index"] == 0 and st["readyGroups"] == 1
    wait_for(lambda: (m := [e.message for e in c.events(ns, "ScaleDown")])
             and any("group 2 draining" in x for x in m) and any("group 1 removed" in x for x in m),
             what="ScaleDown events for every step")
    svcs = sorted(s.metadata.name for s in c.core.list_namespaced_service(ns).items if s.metadata.name.startswith("r1"))
    assert svcs == ["r1", "r1-ranks"]  # per DwdpGroup: nothing to delete with a group
    scale = c.custom.get_namespaced_custom_object_scale("dwdp.io", "v1alpha1", ns, "dwdpgroups", "r1")
    assert scale["spec"]["replicas"] == 1 and scale["status"]["selector"] == "dwdp.io/name=r1"


def test_rollout_replaces_groups_one_at_a_time(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=3))
    ready_groups(c, ns, "r1", 3)
    c.patch_spec(ns, "r1", {"image": "dwdp:v2"})
    min_ready, deadline = 3, time.time() + 60
    while time.time() < deadline:
        pods = c.live_pods(ns)
        images = {p.spec.containers[0].image for p in pods}
        st = c.get_group(ns, "r1").get("status") or {}
        min_ready = min(min_ready, st.get("readyGroups", 3))
        if images == {"dwdp:v2"} and len(pods) == 12 and st.get("readyGroups") == 3:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("rollout did not finish")
    assert min_ready == 2, "maxUnavailableGroups=1: at most one group down at a time"
    st = c.get_group(ns, "r1")["status"]
    assert [g["attempt"] for g in st["groups"]] == [1, 1, 1]
    assert [g["groupRestarts"] for g in st["groups"]] == [0, 0, 0], "a rollout is not a restart"
    assert len(c.events(ns, "RollingUpdate")) >= 3


def test_operator_restart_mid_reconcile_no_duplicates_no_orphans(cluster, ns):
    c = cluster
    op = c.operator
    c.create_group(ns, group_body("r1", numGroups=6))
    wait_for(lambda: len(c.pods(ns)) >= 4, timeout=30, interval=0.005, what="first pods")
    op.kill()  # mid-create
    n_at_kill = len(c.pods(ns))
    op.start()
    st = ready_groups(c, ns, "r1", 6)
    assert [g["attempt"] for g in st["groups"]] == [0] * 6, f"killed at {n_at_kill} pods: no restart"
    # mid group-restart: delete a pod, crash right away, restart: exactly one new attempt
    c.core.delete_namespaced_pod("r1-g2-p0", ns)
    hold(0.3, "the operator starts the group's restart, then crashes")
    op.kill()
    op.start()
    wait_for(lambda: attempts(c, ns, 2) == {"1"} and len(c.live_pods(ns, "dwdp.io/group=2")) == 4, timeout=40,
             what="group 2 attempt 1")
    st = ready_groups(c, ns, "r1", 6)
    assert [g["attempt"] for g in st["groups"]] == [0, 0, 1, 0, 0, 0]
    assert st["groups"][2]["groupRestarts"] == 1
    uid = c.get_group(ns, "r1")["metadata"]["uid"]
    names = [p.metadata.name for p in c.pods(ns)]
    assert len(names) == len(set(names)) == 24
    for p in c.pods(ns):
        assert [o.uid for o in p.metadata.owner_references] == [uid], "no orphans"


def test_delete_garbage_collects_children(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=1))
    ready_groups(c, ns, "r1", 1)
    c.custom.delete_namespaced_custom_object("dwdp.io", "v1alpha1", ns, "dwdpgroups", "r1")

    def gone():
        svcs = [s for s in c.core.list_namespaced_service(ns).items if s.metadata.name.startswith("r1")]
        secs = [s for s in c.core.list_namespaced_secret(ns).items if s.metadata.name == "r1-token"]
        cds = c.custom.list_namespaced_custom_object("resource.nvidia.com", "v1beta1", ns, "computedomains")["items"]
        return not (c.pods(ns) or svcs or secs or cds)
    wait_for(gone, timeout=60, what="children garbage-collected")


def test_prefetch_restarts_from_healthz_land_in_status(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=1))
    ready_groups(c, ns, "r1", 1)
    c.health.values[(ns, "r1-g0-p1")] = 3
    c.health.values[(ns, "r1-g0-p2")] = 4
    wait_for(lambda: c.get_group(ns, "r1")["status"]["groups"][0]["prefetchRestarts"] == 7, timeout=20,
             what="prefetchRestarts=7")


BASE = group_body("x")["spec"]


def _with(**over):
    spec = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(spec.get(k), dict) and k != "model":
            spec[k] = {**spec[k], **v}
        else:
            spec[k] = v
    return spec


INVALID_SPECS = {
    "dwdpsize-1": _with(dwdpSize=1),
    "dwdpsize-string": _with(dwdpSize="four"),
    "no-image": {k: v for k, v in BASE.items() if k != "image"},
    "empty-image": _with(image=""),
    "negative-groups": _with(numGroups=-1),
    "gpus-zero": _with(gpusPerPod=0),
    "gpus-not-dividing": _with(gpusPerPod=3),
    "coverage": _with(experts={"numPrefetchExperts": 3}),
    "stride-gt-k": _with(experts={"numPrefetchExperts": 5}),
    "k-gt-n": _with(experts={"numExperts": 4, "numExpertsPerWorker": 5, "numPrefetchExperts": 1}),
    "one-slot": _with(experts={"numPrefetchSlots": 1}),
    "experts-zero": _with(experts={"numExperts": 0}),
    "bad-transfer": _with(experts={"transfer": "nvlink"}),
    "no-experts-k": {**BASE, "experts": {"numExperts": 16, "numPrefetchExperts": 4}},
    "no-model": _with(model={"dtype": "bfloat16"}),
    "two-models": _with(model={"path": "/m", "synthetic": "mixtral"}),
    "bad-synthetic": _with(model={"synthetic": "llama"}),
    "bad-dtype": _with(model={"synthetic": "mixtral", "dtype": "int8"}),
    "bad-imex": _with(imex={"mode": "Fabric"}),
    "reserved-env": _with(template={"env": [{"name": "DWDP_SIZE", "value": "8"}]}),
    "same-ports": _with(httpPort=9000, storePort=9000),
    "elastic-http-on-a-standby-store": _with(experts={"replicas": 2}, httpPort=29501),  # standby stores: 29501-29504
    "port-range": _with(httpPort=70000),
    "negative-restarts": _with(restartPolicy={"maxRestarts": -1}),
    "zero-unavailable": _with(rollout={"maxUnavailableGroups": 0}),
    "does-not-fit": _with(dwdpSize=2, experts={"numExperts": 256, "numExpertsPerWorker": 128,
                                               "numPrefetchExperts": 128},
                          sizing={"model": "deepseek-r1", "hardware": "h100-hgx"}),
    "bad-sizing-dtype": _with(sizing={"model": "deepseek-r1", "weightDtype": "int3"}),
    "kernel-cache-two-sources": _with(kernelCache={"claimName": "c", "hostPath": "/var/cache/k"}),
    "kernel-cache-env-twice": _with(kernelCache={"claimName": "c"},
                                    template={"env": [{"name": "DWDP_COMPILE_CACHE_DIR", "value": "/x"}]}),
}


def test_invalid_specs_refused_or_marked_invalid(cluster, ns):
    c = cluster
    refused, marked = {}, []
    for i, (case, spec) in enumerate(sorted(INVALID_SPECS.items())):
        body = {"apiVersion": "dwdp.io/v1alpha1", "kind": "DwdpGroup", "metadata": {"name": f"bad-{case}"}, "spec": spec}
        try:
            c.create_group(ns, body)
            marked.append(case)
        except ApiException as e:
            assert e.status == 422, (case, e.status, e.body)
            refused[case] = e.body
    assert len(refused) + len(marked) == len(INVALID_SPECS) >= 20
    assert refused and marked  # both layers are exercised: OpenAPI bounds and the operator's rules
    for case in marked:
        cond = wait_for(lambda: (x := c.condition(ns, f"bad-{case}", "Invalid")) and x["status"] == "True" and x,
                        timeout=30, what=f"{case} marked Invalid")
        assert cond["message"].startswith("spec"), (case, cond)
    # the Event follows the status write of the same pass (status first): wait for it, do not race it
    wait_for(lambda: {f"bad-{m}" for m in marked} <= {e.involved_object.name for e in c.events(ns, "InvalidSpec")},
             timeout=15, what="an InvalidSpec Event per marked object")
    hold(1.5, "a window in which no child may appear for an invalid spec")
    assert not c.pods(ns) and not [s for s in c.core.list_namespaced_service(ns).items]
    print(f"refused by the API server: {sorted(refused)}; marked Invalid by the operator: {sorted(marked)}")


def test_fixing_an_invalid_spec_creates_children(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("r1", numGroups=1, gpusPerPod=3))
    wait_for(lambda: (x := c.condition(ns, "r1", "Invalid")) and x["status"] == "True", what="Invalid")
    c.patch_spec(ns, "r1", {"gpusPerPod": 2})
    wait_for(lambda: len(c.live_pods(ns)) == 2 and c.condition(ns, "r1", "Invalid")["status"] == "False",
             timeout=30, what="2 pods of 2 GPUs once valid")


def test_crd_defaults_applied_by_server(cluster, ns):
    c = cluster
    c.create_group(ns, group_body("d", numGroups=0))
    spec = c.get_group(ns, "d")["spec"]
    assert spec["gpusPerPod"] == 1 and spec["topologyKey"] == "nvidia.com/gpu.clique"
    assert spec["experts"]["numPrefetchSlots"] == 2 and spec["experts"]["transfer"] == "copy_engine"
    assert spec["imex"] == {"mode": "ComputeDomain"} and spec["rollout"] == {"maxUnavailableGroups": 1}
    assert spec["httpPort"] == 8000 and spec["storePort"] == 29500 and spec["model"]["dtype"] == "bfloat16"


def test_kv_transfer_defaults_env_and_ucx_ports(cluster, ns):
    """spec.kvTransfer: server-side defaults, the KV env (contract.KvEnv) on every pod, UCX ports opened."""
    from dwdp_runtime.contract import KvEnv

    c = cluster
    c.create_group(ns, group_body("kv", numGroups=1, kvTransfer={"budgetBytes": 1 << 30}))
    kv = c.get_group(ns, "kv")["spec"]["kvTransfer"]
    assert kv == {"budgetBytes": 1 << 30, "blockBytes": 1 << 20, "ttlSeconds": 30, "leaseSeconds": 30,
                  "tcpPortBase": 30000}
    pods = wait_for(lambda: len(c.live_pods(ns)) == 4 and c.live_pods(ns), timeout=60, what="4 pods")
    env = {e.name: e.value for e in pods[0].spec.containers[0].env}
    assert [e.name for e in pods[0].spec.containers[0].env] == CONTRACT_ENV + [v.value for v in KvEnv]
    assert env["DWDP_KV_BUDGET_BYTES"] == str(1 << 30) and env["UCX_TCP_PORT_RANGE"] == "30000-30063"
    pod_ip = next(e for e in pods[0].spec.containers[0].env if e.name == "DWDP_POD_IP")
    assert pod_ip.value is None and pod_ip.value_from.field_ref.field_path == "status.podIP"  # the downward API
    ports = [p.port for r in c.net.read_namespaced_network_policy("kv", ns).spec.ingress for p in r.ports]
    assert 30000 in ports


def test_kernel_cache_volume_and_variable_on_every_pod(cluster, ns):
    """spec.kernelCache: the API server takes the pods with the volume, mounted where DWDP_COMPILE_CACHE_DIR says."""
    c = cluster
    c.create_group(ns, group_body("kc", numGroups=1, kernelCache={"hostPath": "/var/cache/dwdp-kernels"}))
    pods = wait_for(lambda: len(c.live_pods(ns)) == 4 and c.live_pods(ns), timeout=60, what="4 pods")
    for pod in pods:
        container = pod.spec.containers[0]
        env = {e.name: e.value for e in container.env}
        mount = next(m for m in container.volume_mounts if m.name == "dwdp-kernel-cache")
        volume = next(v for v in pod.spec.volumes if v.name == "dwdp-kernel-cache")
        assert env["DWDP_COMPILE_CACHE_DIR"] == mount.mount_path == "/var/cache/dwdp/kernels"
        assert volume.host_path.path == "/var/cache/dwdp-kernels" and volume.host_path.type == "DirectoryOrCreate"

