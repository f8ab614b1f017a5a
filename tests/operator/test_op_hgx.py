"""HGX placement (imex.mode None): one pod per group holding every GPU, its env parsed by the
worker's real parser, and the worker's rank → GPU map giving each rank its own device while every
rank sees all of them (nothing narrows CUDA_VISIBLE_DEVICES)."""

from dwdp_operator import manifests as M
from dwdp_operator.desired import desired_state
from dwdp_operator.spec import DwdpGroupSpec
from .dwdp_op_util import cr, spec
from dwdp_worker.launch.envcontract import parse_env
from dwdp_worker.launch.gpu_map import rank_devices

HGX = spec(numGroups=2, dwdpSize=8, gpusPerPod=8, imex={"mode": "None"},
           experts={"numExperts": 16, "numExpertsPerWorker": 2, "numPrefetchExperts": 2})


def _pod_env(pod: dict) -> dict[str, str]:
    env = {}
    for e in pod["spec"]["containers"][0]["env"]:
        env[e["name"]] = e["value"] if "value" in e else "token-from-the-secret"
    return env


def test_hgx_group_is_one_pod_with_every_gpu_and_no_imex():
    plan = desired_state(cr(HGX), [], now=1.0, token="t")
    pods = [m for m in plan.creates if m["kind"] == "Pod"]
    assert plan.valid and sorted(p["metadata"]["name"] for p in pods) == ["r1-g0-p0", "r1-g1-p0"]
    assert not [m for m in plan.creates if m["kind"] == "ComputeDomain"]
    for p in pods:
        c = p["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8" == c["resources"]["requests"]["nvidia.com/gpu"]
        assert "resourceClaims" not in p["spec"] and "claims" not in c["resources"]
        names = {e["name"] for e in c["env"]}
        assert not names & {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}


def test_hgx_pod_env_parses_and_every_rank_gets_its_own_device_of_all():
    sp = DwdpGroupSpec.model_validate(HGX)
    pod = M.worker_pod(name="r1", ns="ns", uid="u", g=1, i=0, attempt=0, spec=sp, thash="h")
    env = parse_env({**_pod_env(pod), "DWDP_BACKEND": "auto"})
    assert env.ranks == list(range(8)) and env.gpus_per_pod == env.dwdp_size == 8
    devices = rank_devices(gpus_per_pod=env.gpus_per_pod, visible_gpus=8, backend=env.backend)
    assert devices == [f"cuda:{i}" for i in range(8)]
