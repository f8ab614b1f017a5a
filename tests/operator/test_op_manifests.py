"""Pod manifests: the env contract table, IMEX claim wiring, gang gate, affinity, GPUs, probes."""

import re
from pathlib import Path

from dwdp_operator import manifests as M
from dwdp_operator.spec import DwdpGroupSpec
from dwdp_op_util import spec

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
    assert v["DWDP_RANK_BASE"] == "4" and v["DWDP_ATTEMPT"] == "3" and v["DWDP_STORE_ADDR"] == "r1-g1-p0.r1-g1.ns.svc"
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
