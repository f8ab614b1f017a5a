"""validate_spec: the operator's rules, the shared sharding rules, and the plug-in point."""

import pytest

from dwdp_operator import spec as S
from .dwdp_op_util import spec

INVALID = {
    "dwdp size 1": spec(dwdpSize=1),
    "coverage": spec(experts={"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 3}),
    "stride > k": spec(experts={"numExperts": 16, "numExpertsPerWorker": 4, "numPrefetchExperts": 5}),
    "k > N": spec(experts={"numExperts": 4, "numExpertsPerWorker": 5, "numPrefetchExperts": 1}),
    "one slot": spec(experts={"numPrefetchSlots": 1}),
    "gpus do not divide": spec(gpusPerPod=3),
    "no model": {**spec(), "model": {"dtype": "bfloat16"}},
    "two models": spec(model={"path": "/m", "synthetic": "mixtral"}),
    "bad transfer": spec(experts={"transfer": "nvlink"}),
    "bad dtype": spec(model={"dtype": "int8"}),
    "DWDP_ env": spec(template={"env": [{"name": "DWDP_SIZE", "value": "9"}]}),
    "negative groups": spec(numGroups=-1),
    "unknown field": spec(replicas=3),
    "same ports": spec(httpPort=9000, storePort=9000),
    "hgx split over pods": spec(imex={"mode": "None"}, gpusPerPod=2),
}


def test_valid_base_spec():
    assert S.validate_spec(spec()) == []


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_specs_have_messages(case):
    errors = S.validate_spec(INVALID[case])
    assert errors, case
    assert all(isinstance(e, str) and e.startswith("spec") for e in errors)


def test_sharding_message_comes_from_the_shared_rules():
    errors = S.validate_spec(INVALID["coverage"])
    assert any("coverage rule" in e and "try experts.numExpertsPerWorker" in e for e in errors)
    assert not any("num_experts" in e or "dwdp_size" in e for e in errors)  # the spec's own names


def test_hgx_rule_one_pod_per_group_without_imex():
    errors = S.validate_spec(spec(imex={"mode": "None"}, gpusPerPod=1))
    assert len(errors) == 1 and S.HGX_FIX in errors[0] and "spec.gpusPerPod=1" in errors[0]
    assert S.validate_spec(spec(imex={"mode": "None"}, gpusPerPod=4)) == []
    assert S.validate_spec(spec(imex={"mode": "ComputeDomain"}, gpusPerPod=1)) == []


def test_memory_fit_is_a_registered_check():
    from dwdp_operator import sizing

    assert sizing.memory_fit_errors in S.CHECKS


def test_zero_groups_is_a_valid_scale_to_zero():
    assert S.validate_spec(spec(numGroups=0)) == []


def test_register_check_plugs_a_rule_in():
    @S.register_check
    def too_many(sp):
        return ["spec.numGroups: planner says no"] if sp.numGroups > 100 else []
    try:
        assert S.validate_spec(spec(numGroups=101)) == ["spec.numGroups: planner says no"]
        assert S.validate_spec(spec(numGroups=3)) == []
    finally:
        S.CHECKS.remove(too_many)


def test_never_raises_on_garbage():
    for raw in (None, {}, {"experts": "x"}, {"dwdpSize": "four"}):
        assert S.validate_spec(raw)
