"""The pod env contract: the parser reads exactly docs/ENV_CONTRACT.md and names every bad variable."""

from __future__ import annotations

import re

import pytest

from .serving_helpers import ROOT

from dwdp_worker.launch.envcontract import ENV_VARS, POD_PLACEHOLDER, EnvContractError, parse_env
from dwdp_worker.launch.pod import build_pod_specs

GOOD = {
    "DWDP_JOB": "r1", "DWDP_NAMESPACE": "default", "DWDP_GROUP": "2", "DWDP_POD_INDEX": "1",
    "DWDP_RANK_BASE": "2", "DWDP_GPUS_PER_POD": "2", "DWDP_SIZE": "4",
    "DWDP_STORE_ADDR": "r1-g2-p0.r1-g2.default.svc", "DWDP_STORE_PORT": "29500", "DWDP_ATTEMPT": "3",
    "DWDP_TOKEN": "s3cret", "DWDP_NUM_EXPERTS": "256", "DWDP_EXPERTS_PER_WORKER": "64",
    "DWDP_PREFETCH_STRIDE": "64", "DWDP_PREFETCH_SLOTS": "2", "DWDP_CONTENTION_OPT": "true",
    "DWDP_TRANSFER": "copy_engine", "DWDP_MODEL": "/models/r1", "DWDP_MODEL_SYNTHETIC": "",
    "DWDP_DTYPE": "bfloat16", "DWDP_BACKEND": "host", "DWDP_HTTP_PORT": "8000",
}


def test_env_vars_are_exactly_the_documented_table():
    doc = (ROOT / "docs" / "ENV_CONTRACT.md").read_text()
    documented = re.findall(r"^\| `(DWDP_[A-Z_]+)` \|", doc, flags=re.M)
    assert documented and sorted(documented) == sorted(ENV_VARS)
    assert set(GOOD) == set(ENV_VARS)


def test_good_env_parses_and_gives_the_pod_ranks():
    env = parse_env({**GOOD, "UNRELATED": "x"})
    assert env.ranks == [2, 3] and env.attempt == 3 and env.contention_opt is True
    cfg = env.dwdp_config()
    assert (cfg.dwdp_size, cfg.num_experts, cfg.num_experts_per_worker, cfg.num_prefetch_experts) == (4, 256, 64, 64)
    specs = build_pod_specs(env, "/models/r1", rendezvous_timeout_s=5)
    assert [(s.rank, s.group, s.global_id, s.backend, s.device) for s in specs] == \
        [(2, 2, 0, "host", None), (3, 2, 1, "host", None)]
    assert {(s.store_host, s.store_port, s.attempt, s.token) for s in specs} == \
        {("r1-g2-p0.r1-g2.default.svc", 29500, 3, "s3cret")}


@pytest.mark.parametrize("var", [v for v in ENV_VARS if v not in ("DWDP_MODEL", "DWDP_MODEL_SYNTHETIC")])
def test_each_missing_variable_is_named(var):
    env = dict(GOOD)
    del env[var]
    with pytest.raises(EnvContractError, match=var):
        parse_env(env)


@pytest.mark.parametrize("var,value,needle", [
    ("DWDP_SIZE", "four", "DWDP_SIZE='four'"),
    ("DWDP_STORE_PORT", "70000", "DWDP_STORE_PORT"),
    ("DWDP_CONTENTION_OPT", "maybe", "DWDP_CONTENTION_OPT"),
    ("DWDP_TRANSFER", "nvlink", "DWDP_TRANSFER"),
    ("DWDP_DTYPE", "fp8", "DWDP_DTYPE"),
    ("DWDP_BACKEND", "tpu", "DWDP_BACKEND"),
    ("DWDP_TOKEN", "", "DWDP_TOKEN"),
    ("DWDP_RANK_BASE", "0", "DWDP_RANK_BASE=0 must equal"),
    ("DWDP_GPUS_PER_POD", "3", "not a multiple of DWDP_GPUS_PER_POD=3"),
    ("DWDP_PREFETCH_STRIDE", "65", "stride must be <= experts per worker"),
    ("DWDP_EXPERTS_PER_WORKER", "32", "coverage rule"),
    ("DWDP_MODEL_SYNTHETIC", "qwen3_moe", "exactly one of DWDP_MODEL"),
    ("DWDP_MODEL", "", "exactly one of DWDP_MODEL"),
])
def test_bad_values_are_named_with_the_fix(var, value, needle):
    env = {**GOOD, var: value}
    if var == "DWDP_PREFETCH_STRIDE":
        env["DWDP_EXPERTS_PER_WORKER"] = "64"
    if var == "DWDP_EXPERTS_PER_WORKER":
        env["DWDP_PREFETCH_STRIDE"] = "32"
    with pytest.raises(EnvContractError) as info:
        parse_env(env)
    assert needle in str(info.value)


def test_pod_with_bad_env_exits_2_naming_the_variable():
    from .serving_helpers import child_env
    import subprocess
    import sys

    env = child_env({k: v for k, v in GOOD.items() if k != "DWDP_STORE_ADDR"})
    p = subprocess.run([sys.executable, "-m", "dwdp_worker.launch.cli", "pod"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert "DWDP_STORE_ADDR" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("gpus_per_pod,pod_index", [(1, 3), (2, 1), (4, 0)])
def test_the_operators_pod_env_parses(gpus_per_pod, pod_index):
    """Both sides of the contract: the env the operator renders is accepted by the worker as is."""
    pytest.importorskip("dwdp_operator.manifests")
    from dwdp_operator.manifests import worker_env
    from dwdp_operator.spec import DwdpGroupSpec

    spec = DwdpGroupSpec.model_validate({
        "numGroups": 2, "dwdpSize": 4, "gpusPerPod": gpus_per_pod, "image": "dwdp:test",
        "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4},
        "model": {"synthetic": "qwen3_moe"}})
    env = worker_env(name="r1", ns="prod", g=1, i=pod_index, attempt=2, spec=spec)
    values = {e["name"]: e.get("value", "from-secret") for e in env}  # DWDP_TOKEN comes from the Secret
    parsed = parse_env(values)
    assert parsed.ranks == list(range(pod_index * gpus_per_pod, (pod_index + 1) * gpus_per_pod))
    assert (parsed.group, parsed.attempt, parsed.model_synthetic) == (1, 2, "qwen3_moe")
    assert parsed.dwdp_config().num_experts == 16


# -- the contract module is the one definition: operator, worker parser and docs agree with it --------------

def _operator():
    pytest.importorskip("dwdp_operator.manifests")
    from dwdp_operator import manifests, spec

    return manifests, spec


def _spec(spec_mod, **experts_and_model):
    model = experts_and_model.pop("model", {"synthetic": "qwen3_moe"})
    return spec_mod.DwdpGroupSpec.model_validate({
        "dwdpSize": 4, "image": "dwdp:test", "model": model,
        "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4, **experts_and_model}})


def test_rendered_pod_env_is_the_contract_in_order():
    from dwdp_runtime import contract
    from dwdp_worker.launch.envcontract import PodEnv

    manifests, spec_mod = _operator()
    rendered = manifests.worker_env(name="r1", ns="prod", g=0, i=1, attempt=0, spec=_spec(spec_mod))
    names = [e["name"] for e in rendered]
    assert names == [v.value for v in contract.POD_ENV]
    assert all(type(n) is str for n in names)  # exact str: yaml.safe_dump and every client serialize it
    assert set(spec_mod.CONTRACT_ENV) == set(names) == set(ENV_VARS)
    assert sorted(f.alias for f in PodEnv.model_fields.values()) == sorted(names)
    doc = (ROOT / "docs" / "ENV_CONTRACT.md").read_text()
    assert re.findall(r"^\| `(DWDP_[A-Z_]+)` \|", doc, flags=re.M) == names  # the table, in the same order


@pytest.mark.parametrize("transfer", ["copy_engine", "batched", "sm_gather"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_every_transfer_and_dtype_crosses_from_the_operator_to_the_worker(transfer, dtype):
    from dwdp_runtime.config import TRANSFER_MODES
    from dwdp_runtime.contract import ModelDtype, Transfer

    assert TRANSFER_MODES == tuple(Transfer) and transfer in TRANSFER_MODES and dtype in tuple(ModelDtype)
    manifests, spec_mod = _operator()
    spec = _spec(spec_mod, transfer=transfer, model={"synthetic": "mixtral", "dtype": dtype})
    env = manifests.worker_env(name="r1", ns="prod", g=0, i=0, attempt=0, spec=spec)
    parsed = parse_env({e["name"]: e.get("value", "from-secret") for e in env})
    assert (parsed.transfer, parsed.dtype, parsed.backend) == (transfer, dtype, "auto")
    assert parsed.dwdp_config().transfer == transfer


def test_unknown_transfer_is_refused_on_both_sides():
    manifests, spec_mod = _operator()
    assert any("transfer" in m for m in spec_mod.validate_spec(
        {"dwdpSize": 4, "image": "x", "model": {"synthetic": "qwen3_moe"},
         "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4, "transfer": "nvlink"}}))
    with pytest.raises(EnvContractError, match="DWDP_TRANSFER"):
        parse_env({**GOOD, "DWDP_TRANSFER": "nvlink"})


def test_tuning_variables_pass_through_template_env_but_contract_ones_are_refused():
    from dwdp_runtime.contract import POD_ENV, POD_ENV_OPTIONAL, RESERVED_POD_ENV, TuningEnv

    _, spec_mod = _operator()
    assert not set(TuningEnv) & RESERVED_POD_ENV
    assert not {v.value for v in POD_ENV} & set(POD_ENV_OPTIONAL)  # a variable is required or optional
    base = {"dwdpSize": 4, "image": "x", "model": {"synthetic": "qwen3_moe"},
            "experts": {"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 4}}
    assert spec_mod.validate_spec({**base, "template": {"env": [{"name": str(TuningEnv.SM_GATHER_CTAS),
                                                                   "value": "0"}]}}) == []
    for var in sorted(RESERVED_POD_ENV):  # every pod's contract and the optional, per-feature names
        errors = spec_mod.validate_spec({**base, "template": {"env": [{"name": var, "value": "1"}]}})
        assert errors and var in errors[0]


def test_the_crd_enums_are_the_contract_values():
    """The CRD (YAML, so it cannot import) spells the transfer modes and dtypes: pinned here."""
    import yaml

    from dwdp_runtime.contract import ModelDtype, Transfer

    crd = yaml.safe_load((ROOT / "crds" / "dwdpgroup.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    transfer = spec["experts"]["properties"]["transfer"]
    dtype = spec["model"]["properties"]["dtype"]
    assert transfer["enum"] == [m.value for m in Transfer] and transfer["default"] == Transfer.COPY_ENGINE
    assert dtype["enum"] == [m.value for m in ModelDtype] and dtype["default"] == ModelDtype.BFLOAT16


def test_expert_replicas_cross_from_the_spec_to_the_rank_config_only_when_set():
    """spec.experts.replicas → DWDP_EXPERT_REPLICAS (contract.LayoutEnv, absent = 1) → DwdpConfig.expert_replicas."""
    from dwdp_runtime.contract import POD_ENV_OPTIONAL, LayoutEnv

    assert LayoutEnv.EXPERT_REPLICAS in POD_ENV_OPTIONAL
    manifests, spec_mod = _operator()
    plain = manifests.worker_env(name="r1", ns="prod", g=0, i=0, attempt=0, spec=_spec(spec_mod))
    assert LayoutEnv.EXPERT_REPLICAS not in [e["name"] for e in plain]  # r = 1: today's pods, byte for byte
    assert parse_env({e["name"]: e.get("value", "t") for e in plain}).dwdp_config().expert_replicas == 1
    env = manifests.worker_env(name="r1", ns="prod", g=0, i=0, attempt=0, spec=_spec(spec_mod, replicas=2))
    parsed = parse_env({e["name"]: e.get("value", "t") for e in env})
    assert parsed.expert_replicas == 2 and parsed.dwdp_config().holders().replicas[0] == ((12, 16),)
    with pytest.raises(EnvContractError, match="DWDP_EXPERT_REPLICAS.*expert_replicas=5 must be in"):
        parse_env({**GOOD, "DWDP_EXPERT_REPLICAS": "5"})
    with pytest.raises(EnvContractError, match="DWDP_EXPERT_REPLICAS='two': must be an integer"):
        parse_env({**GOOD, "DWDP_EXPERT_REPLICAS": "two"})


def test_local_launcher_takes_expert_replicas():
    from dwdp_worker.launch.local import build_local_specs

    specs = build_local_specs(model_dir="/nonexistent", groups=1, dwdp_size=4, experts_per_worker=2,
                              prefetch_stride=2, expert_replicas=2, backend="host", num_experts=8)
    assert {s.config["expert_replicas"] for s in specs} == {2}
    with pytest.raises(ValueError, match="expert_replicas=5 must be in \\[1, dwdp_size=4\\]"):
        build_local_specs(model_dir="/nonexistent", groups=1, dwdp_size=4, experts_per_worker=2,
                          prefetch_stride=2, expert_replicas=5, backend="host", num_experts=8)


def test_pod_addr_template_crosses_from_the_operator_only_for_an_elastic_group():
    """spec.experts.replicas > 1 → DWDP_POD_ADDR_TEMPLATE (contract.ElasticEnv) → PodEnv.pod_addr_template."""
    from dwdp_runtime.contract import POD_ENV_OPTIONAL, ElasticEnv

    assert ElasticEnv.POD_ADDR_TEMPLATE in POD_ENV_OPTIONAL
    manifests, spec_mod = _operator()
    plain = manifests.worker_env(name="r1", ns="prod", g=1, i=0, attempt=0, spec=_spec(spec_mod))
    assert parse_env({e["name"]: e.get("value", "t") for e in plain}).pod_addr_template is None
    env = manifests.worker_env(name="r1", ns="prod", g=1, i=3, attempt=0, spec=_spec(spec_mod, replicas=2))
    parsed = parse_env({e["name"]: e.get("value", "t") for e in env})
    assert parsed.pod_addr_template == "r1-g1-p{pod}.r1-ranks.prod.svc"
    assert parsed.pod_addr_template.replace(POD_PLACEHOLDER, "0") == parsed.store_addr  # rank 0's pod hosts the store


@pytest.mark.parametrize("value", ["r1-g1-p0.r1-ranks.prod.svc", "r1-g1-p{pod}-{pod}.r1-ranks.prod.svc",
                                   "r1-g1-p{pod}.{ns}.svc", "r1-g1-p{POD}.r1-ranks.prod.svc", "r1-g1-p{{pod}}.svc",
                                   "r1-g1-p{pod.r1-ranks.prod.svc", ""])
def test_a_pod_addr_template_without_exactly_one_placeholder_is_refused_with_an_example(value):
    with pytest.raises(EnvContractError) as info:
        parse_env({**GOOD, "DWDP_EXPERT_REPLICAS": "2", "DWDP_POD_ADDR_TEMPLATE": value})
    message = str(info.value)
    assert message.startswith(f"DWDP_POD_ADDR_TEMPLATE={value!r}: must hold the pod index placeholder {{pod}} exactly "
                              f"once and no other brace")
    assert "e.g. 'r1-g0-p{pod}.r1-ranks.default.svc'" in message
