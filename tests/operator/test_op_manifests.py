"""Pod manifests: the env contract table, IMEX claim wiring, gang gate, affinity, GPUs, probes."""

import re
from pathlib import Path

from dwdp_operator import manifests as M
from dwdp_operator.spec import DwdpGroupSpec
from .dwdp_op_util import spec

ROOT = Path(__file__).resolve().parents[2]


def contract_names():
    text = (ROOT / "docs/ENV_CONTRACT.md").read_text()
    return re.findall(r"^\| `(DWDP_[A-Z_]+)` \|", text, re.M)


def pod(**over):
    sp = DwdpGroupSpec.model_validate(spec(**over))
    return M.worker_pod(name="r1", ns="ns", uid="u", g=1, i=2, attempt=3, spec=sp, thash="h")


def test_env_is_exactly_the_contract_in_order():
    env = pod(gpusPerPod=2)["spec"]["containers"][0]["env"]
    assert [e["name"] for e in env] == contract_names()
    v = {e["name"]: e.get("value") for e in env}
    assert v["DWDP_RANK_BASE"] == "4" and v["DWDP_ATTEMPT"] == "3" and v["DWDP_STORE_ADDR"] == "r1-g1-p0.r1-ranks.ns.svc"
    assert v["DWDP_MODEL"] == "" and v["DWDP_MODEL_SYNTHETIC"] == "qwen3_moe" and v["DWDP_TOKEN"] is None


def test_imex_claim_gate_affinity_gpus():
    p = pod(gpusPerPod=2, topologyKey="example.com/clique")
    s, c = p["spec"], p["spec"]["containers"][0]
    assert s["resourceClaims"] == [{"name": "imex-channel", "resourceClaimTemplateName": "r1-imex-channel"}]
    assert c["resources"]["claims"] == [{"name": "imex-channel"}]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2" == c["resources"]["requests"]["nvidia.com/gpu"]
    assert s["schedulingGates"] == [{"name": "dwdp.io/gang"}]
    aff = s["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert aff["topologyKey"] == "example.com/clique"
    assert aff["labelSelector"]["matchLabels"] == {"dwdp.io/name": "r1", "dwdp.io/group": "1"}
    assert c["command"] == ["dwdp-worker", "pod"] and c["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert M.lift_gate_patch()["spec"]["schedulingGates"] is None
    no_imex = pod(imex={"mode": "None"})
    assert "resourceClaims" not in no_imex["spec"] and "claims" not in no_imex["spec"]["containers"][0]["resources"]


def test_template_hash_ignores_scale_restart_and_rollout():
    a = DwdpGroupSpec.model_validate(spec())
    assert M.template_hash(a) == M.template_hash(DwdpGroupSpec.model_validate(
        spec(numGroups=7, restartPolicy={"maxRestarts": 1}, rollout={"maxUnavailableGroups": 3})))
    assert M.template_hash(a) != M.template_hash(DwdpGroupSpec.model_validate(spec(image="other")))


def _scan_strings(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _scan_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _scan_strings(v)
    elif isinstance(obj, str):
        yield obj


def test_worker_pod_non_root_read_only_no_capabilities():
    p = pod(template={"volumes": [{"name": "m", "emptyDir": {}}], "volumeMounts": [{"name": "m", "mountPath": "/m"}]})
    s, c = p["spec"], p["spec"]["containers"][0]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0 and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and "add" not in sc["capabilities"]
    assert s["securityContext"]["runAsNonRoot"] is True and s["securityContext"]["runAsUser"] != 0
    assert s["automountServiceAccountToken"] is False
    # read-only root: every path the worker writes is an emptyDir; the user's volumes still come after
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in s["volumes"]}
    assert {"/tmp", "/home/dwdp", "/m"} <= set(mounts)
    assert "emptyDir" in vols[mounts["/tmp"]] and "emptyDir" in vols[mounts["/home/dwdp"]]
    assert set(mounts.values()) <= set(vols)


def test_token_never_in_pod_spec_in_plain_text():
    sp = DwdpGroupSpec.model_validate(spec())
    token = "s3cr3t-token-value-xyz"
    secret = M.token_secret(name="r1", ns="ns", uid="u", token=token)
    assert secret["kind"] == "Secret" and secret["stringData"]["token"] == token
    p = M.worker_pod(name="r1", ns="ns", uid="u", g=0, i=0, attempt=0, spec=sp, thash="h")
    assert not any(token in x for x in _scan_strings(p))
    env = {e["name"]: e for e in p["spec"]["containers"][0]["env"]}
    assert "value" not in env["DWDP_TOKEN"]
    assert env["DWDP_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "r1-token", "key": "token"}}


def test_network_policy_store_port_only_from_own_workers():
    sp = DwdpGroupSpec.model_validate(spec(httpPort=8100, storePort=29600))
    np = M.network_policy(name="r1", ns="ns", uid="u", spec=sp)
    own = {"dwdp.io/name": "r1", "app.kubernetes.io/component": "worker"}
    assert np["spec"]["podSelector"] == {"matchLabels": own} and np["spec"]["policyTypes"] == ["Ingress"]
    store, http = np["spec"]["ingress"]
    assert store["ports"] == [{"protocol": "TCP", "port": 29600}]
    assert store["from"] == [{"podSelector": {"matchLabels": own}}]  # no namespaceSelector: same namespace
    assert http == {"ports": [{"protocol": "TCP", "port": 8100}]}   # HTTP from anywhere, no other port
    assert np["metadata"]["ownerReferences"][0]["kind"] == "DwdpGroup"
    # the policy selects every group's workers of the DwdpGroup, and no other pod
    for g in (0, 3):
        p = M.worker_pod(name="r1", ns="ns", uid="u", g=g, i=1, attempt=0, spec=sp, thash="h")
        assert own.items() <= p["metadata"]["labels"].items()
    other = M.worker_pod(name="r10", ns="ns", uid="u", g=0, i=1, attempt=0, spec=sp, thash="h")
    assert not own.items() <= other["metadata"]["labels"].items()
    client = M.client_service(name="r1", ns="ns", uid="u", spec=sp)
    assert not own.items() <= client["metadata"]["labels"].items()


def test_rank_service_resolves_every_groups_rank0():
    """One headless Service per DwdpGroup: each pod's DNS name is <hostname>.<name>-ranks, and group g's
    store address is its rank-0 pod's name there (unique across groups)."""
    sp = DwdpGroupSpec.model_validate(spec(numGroups=3))
    svc = M.rank_service(name="r1", ns="ns", uid="u", spec=sp)
    assert svc["metadata"]["name"] == "r1-ranks"
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    seen = set()
    for g in range(3):
        p = M.worker_pod(name="r1", ns="ns", uid="u", g=g, i=0, attempt=0, spec=sp, thash="h")
        assert svc["spec"]["selector"].items() <= p["metadata"]["labels"].items()
        assert p["spec"]["subdomain"] == "r1-ranks"
        env = {e["name"]: e.get("value") for e in p["spec"]["containers"][0]["env"]}
        assert env["DWDP_STORE_ADDR"] == f"{p['spec']['hostname']}.r1-ranks.ns.svc"
        seen.add(env["DWDP_STORE_ADDR"])
    assert len(seen) == 3


def test_observed_pod_reports_unschedulable_since():
    from dwdp_operator.observed import slim_pod

    body = {"metadata": {"name": "p", "labels": {}}, "spec": {},
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "lastTransitionTime": "2026-11-29T10:00:00Z"}]}}
    assert slim_pod(body)["unschedulable_since"] == "2026-11-29T10:00:00Z"
    body["status"]["conditions"][0].update(status="True", reason="")
    assert slim_pod(body)["unschedulable_since"] == ""
