"""spec.serving reaches the worker's front through the env contract: the operator renders
contract.ServingEnv only when the section is there, the worker's parser turns it into its flags,
an absent section changes nothing (no roll of existing groups), a changed one rolls."""

import pytest

from dwdp_operator import manifests as M
from dwdp_operator.spec import DwdpGroupSpec, validate_spec
from .dwdp_op_util import spec
from dwdp_runtime.contract import ServingEnv
from dwdp_worker.launch.envcontract import EnvContractError, serving_overrides


def _env(**over) -> dict[str, str]:
    sp = DwdpGroupSpec.model_validate(spec(**over))
    pod = M.worker_pod(name="r1", ns="ns", uid="u", g=0, i=0, attempt=0, spec=sp, thash="h")
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_serving_section_becomes_the_worker_flags():
    env = _env(serving={"maxQueue": 32, "maxNumTokens": 4096, "maxNewTokens": 24, "servedModelName": "r1-prefill",
                        "cudaGraphs": 4, "batchInvariant": True})
    assert {v.value for v in ServingEnv} <= set(env)
    assert env["DWDP_BATCH_INVARIANT"] == "true"
    assert serving_overrides(env) == {"max_queue": 32, "max_num_tokens": 4096, "max_num_seqs": 256,
                                      "max_new_tokens": 24, "served_model_name": "r1-prefill", "cuda_graphs": 4,
                                      "batch_invariant": True}
    # unset: rendered empty, so the worker decides (prefill_graphs.rank_cuda_graphs: on where graphs can run)
    assert _env(serving={"maxQueue": 8})[ServingEnv.CUDA_GRAPHS] == ""
    assert "cuda_graphs" not in serving_overrides(_env(serving={"maxQueue": 8}))
    assert serving_overrides(_env(serving={"maxQueue": 8}))["batch_invariant"] is False


def test_absent_serving_sets_nothing_and_keeps_the_template_hash():
    assert not {v.value for v in ServingEnv} & set(_env())
    assert serving_overrides(_env()) == {}
    base = DwdpGroupSpec.model_validate(spec())
    assert M.template_hash(base) == M.template_hash(DwdpGroupSpec.model_validate({**spec(), "serving": None}))
    assert M.template_hash(base) != M.template_hash(DwdpGroupSpec.model_validate(spec(serving={"maxQueue": 8})))


def test_served_model_name_unset_keeps_the_default_name():
    env = _env(serving={"maxQueue": 8})
    assert env[ServingEnv.SERVED_MODEL_NAME] == "" and "served_model_name" not in serving_overrides(env)


@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_bad_serving_env_names_the_variable(bad):
    with pytest.raises(EnvContractError, match="DWDP_MAX_QUEUE"):
        serving_overrides({"DWDP_MAX_QUEUE": bad})


@pytest.mark.parametrize("bad", ["-1", "some"])
def test_bad_cuda_graphs_env_is_refused_and_zero_is_off(bad):
    with pytest.raises(EnvContractError, match=r"DWDP_CUDA_GRAPHS.*>= 0"):
        serving_overrides({"DWDP_CUDA_GRAPHS": bad})
    assert serving_overrides({"DWDP_CUDA_GRAPHS": "0"}) == {"cuda_graphs": 0}


def test_serving_bounds_and_reserved_names():
    assert validate_spec(spec(serving={"maxQueue": 0}))
    assert validate_spec(spec(serving={"cudaGraphs": -1})) and validate_spec(spec(serving={"cudaGraphs": 65}))
    assert not validate_spec(spec(serving={"cudaGraphs": 64}))
    assert not validate_spec(spec(serving={"batchInvariant": True}))
    [both] = validate_spec(spec(serving={"batchInvariant": True, "cudaGraphs": 2}))
    assert "batchInvariant excludes serving.cudaGraphs" in both and "cudaGraphs=2" in both
    assert validate_spec(spec(template={"env": [{"name": "DWDP_MAX_QUEUE", "value": "9"}]}))
