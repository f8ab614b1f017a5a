"""``ServingOptions``: one definition of the front's settings, read by the CLI, the pod env, the operator's
``spec.serving``, the planner and the front (each default written once)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .serving_helpers import ROOT  # noqa: F401 - puts this checkout on sys.path

from dwdp_operator.spec import Serving
from dwdp_runtime.contract import ServingEnv
from dwdp_runtime.serving_options import DEFAULTS, ServingOptions, camel
from dwdp_worker.launch.envcontract import EnvContractError, serving_overrides
from dwdp_worker.launch.local import add_local_arguments
from dwdp_worker.launch.pod import add_pod_arguments


def _parsed(add, argv=()) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("add,argv", [(add_local_arguments, ["--local", "--synthetic", "qwen3_moe"]), (add_pod_arguments, [])])
def test_every_flag_default_is_the_options_default(add, argv):
    args = _parsed(add, argv)
    assert {f: getattr(args, f) for f in ServingOptions.model_fields} == DEFAULTS.model_dump()


def test_the_spec_serving_section_is_the_same_fields():
    schema = Serving.model_json_schema()["properties"]
    ours = ServingOptions.model_json_schema()["properties"]
    assert set(schema) == {camel(f) for f in ServingOptions.model_fields}
    for f in ServingOptions.model_fields:
        theirs = {k: v for k, v in schema[camel(f)].items() if k != "title"}
        assert theirs == {k: v for k, v in ours[f].items() if k != "title"}, f
    assert Serving().options() == DEFAULTS


def test_env_names_are_the_contract():
    assert [ServingOptions.env_var(f) for f in ServingOptions.model_fields] == list(ServingEnv)


@settings(max_examples=60, deadline=None)
@given(queue=st.integers(1, 10**6), tokens=st.integers(1, 10**7), seqs=st.integers(1, 65536),
       new=st.integers(1, 10**6), graphs=st.integers(0, 64), invariant=st.booleans(),
       name=st.one_of(st.none(), st.text("abcdefgh-0123", min_size=1, max_size=12)))
def test_the_operator_env_reads_back_as_the_same_options(queue, tokens, seqs, new, graphs, invariant, name):
    sv = Serving(maxQueue=queue, maxNumTokens=tokens, maxNumSeqs=seqs, maxNewTokens=new, cudaGraphs=graphs,
                 servedModelName=name, batchInvariant=invariant)
    env = {str(k): v for k, v in sv.options().env()}
    assert ServingOptions(**serving_overrides(env)) == sv.options()


@pytest.mark.parametrize("var,bad,bound", [("DWDP_MAX_NUM_SEQS", "65537", "<= 65536"),
                                           ("DWDP_MAX_NUM_TOKENS", "lots", ">= 1"),
                                           ("DWDP_CUDA_GRAPHS", "65", "<= 64"),
                                           ("DWDP_BATCH_INVARIANT", "maybe", "true or false")])
def test_a_bad_env_value_names_the_variable_and_the_bound(var, bad, bound):
    with pytest.raises(EnvContractError) as err:
        serving_overrides({var: bad})
    assert var in str(err.value) and bound in str(err.value) and repr(bad) in str(err.value)


def test_a_flag_out_of_bounds_is_refused_before_anything_starts(tmp_path):
    """Exit 2 with one line naming the flag; no checkpoint is written, no rank started."""
    out = subprocess.run([sys.executable, "-m", "dwdp_worker.launch.cli", "--local", "--model", str(tmp_path / "none"),
                          "--groups", "1", "--dwdp-size", "2", "--max-num-seqs", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "--max-num-seqs=0: must be an integer >= 1" in out.stderr
    assert "Traceback" not in out.stderr


def test_batch_invariant_is_a_switch_on_the_cli_and_in_the_env():
    """``--batch-invariant`` / ``--no-batch-invariant`` (default off); the pod env spells it ``true`` / ``false``."""
    assert _parsed(add_pod_arguments, ["--batch-invariant"]).batch_invariant is True
    assert _parsed(add_pod_arguments, ["--batch-invariant", "--no-batch-invariant"]).batch_invariant is False
    assert dict(ServingOptions(batch_invariant=True).env())[ServingEnv.BATCH_INVARIANT] == "true"
    assert serving_overrides({"DWDP_BATCH_INVARIANT": "false"}) == {"batch_invariant": False}


def test_batch_invariant_without_a_gpu_is_refused_before_anything_starts(tmp_path):
    from dwdp_worker.launch.group import check_batch_invariant

    check_batch_invariant(False, 0)
    check_batch_invariant(True, 1)
    with pytest.raises(ValueError, match="--batch-invariant: .*need the ranks on GPUs"):
        check_batch_invariant(True, 0)
    check_batch_invariant(False, 1, cuda_graphs=4)
    with pytest.raises(ValueError, match="--batch-invariant excludes --cuda-graphs=4: .*host"):
        check_batch_invariant(True, 1, cuda_graphs=4)
