"""spec.sizing: the operator refuses a group that cannot fit GPU memory (numbers in the message) and
shows the planner's predicted gain in status.sizing."""

from dwdp_operator.desired import desired_state
from dwdp_operator.spec import validate_spec
from dwdp_runtime.planner import memory_fit, plan

from .dwdp_op_util import cr, spec

R1_D2 = {"numExperts": 256, "numExpertsPerWorker": 128, "numPrefetchExperts": 128}
R1_D4 = {"numExperts": 256, "numExpertsPerWorker": 64, "numPrefetchExperts": 64}


def test_group_that_cannot_fit_is_invalid_with_the_numbers():
    s = spec(dwdpSize=2, experts=R1_D2, sizing={"model": "deepseek-r1", "hardware": "h100-hgx"})
    errors = validate_spec(s)
    fits, message, _ = memory_fit(model="deepseek-r1", dtype="bf16", hardware="h100-hgx", dwdp_size=2,
                                  experts_per_worker=128, prefetch_stride=128, prefetch_slots=2)
    assert not fits and errors == [f"spec.sizing: {message}"]
    assert "does not fit" in message and "GiB" in message
    p = desired_state(cr(s), [], now=1000.0)
    assert not p.valid and not any(m["kind"] == "Pod" for m in p.creates)
    inv = next(c for c in p.status["conditions"] if c["type"] == "Invalid")
    assert inv["status"] == "True" and "does not fit" in inv["message"]


def test_group_that_fits_shows_the_predicted_speedup():
    s = spec(dwdpSize=4, experts=R1_D4,
             sizing={"model": "deepseek-r1", "hardware": "gb200-nvl72", "weightDtype": "nvfp4", "isl": 16384})
    assert validate_spec(s) == []
    p = desired_state(cr(s), [], now=1000.0)
    sized = p.status["sizing"]
    expected = plan(model="deepseek-r1", dtype="nvfp4", hardware="gb200-nvl72", isl=16384, dwdp_size=4,
                    experts_per_worker=64, prefetch_stride=64, prefetch_slots=2, with_crossover=False,
                    with_recommendation=False)
    assert sized["fits"] is True and sized["message"].startswith("fits:")
    assert abs(sized["predictedSpeedup"] - expected.speedup) < 1e-3


def test_unknown_preset_is_a_message_not_a_crash():
    s = spec(sizing={"model": "gpt-17", "hardware": "h200-hgx"})
    (err,) = validate_spec(s)
    assert err.startswith("spec.sizing:") and "gpt-17" in err


def test_sizing_does_not_roll_pods():
    from dwdp_operator.manifests import template_hash
    from dwdp_operator.spec import parse_spec

    a, _ = parse_spec(spec())
    b, _ = parse_spec(spec(sizing={"model": "deepseek-r1"}))
    assert template_hash(a) == template_hash(b)


def test_contract_env_is_reserved_but_tuning_knobs_pass():
    from dwdp_operator.manifests import worker_env
    from dwdp_operator.spec import CONTRACT_ENV, parse_spec

    parsed, _ = parse_spec(spec())
    assert tuple(v["name"] for v in worker_env(name="r1", ns="ns", g=0, i=0, attempt=0, spec=parsed)) == CONTRACT_ENV
    (err,) = validate_spec(spec(template={"env": [{"name": "DWDP_ATTEMPT", "value": "7"}]}))
    assert "DWDP_ATTEMPT is set by the operator" in err
    assert validate_spec(spec(template={"env": [{"name": "DWDP_SM_GATHER_CTAS", "value": "0"}]})) == []
