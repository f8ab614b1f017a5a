import pytest

from dwdp_runtime.config import DwdpConfig, sharding_errors, suggest_sharding


def test_paper_example_suggestion():
    # DeepSeek-R1: 256 experts on DWDP3 → 86 per worker, stride 85 (ranges overlap by one expert)
    assert suggest_sharding(dwdp_size=3, num_experts=256) == (86, 85)
    cfg = DwdpConfig.even(dwdp_size=3, num_experts=256)
    assert (cfg.num_experts_per_worker, cfg.num_prefetch_experts) == (86, 85)


@pytest.mark.parametrize("d,n", [(2, 8), (3, 256), (4, 7), (5, 128), (7, 13), (8, 257)])
def test_suggestion_is_always_valid(d, n):
    k, s = suggest_sharding(dwdp_size=d, num_experts=n)
    assert sharding_errors(dwdp_size=d, num_experts=n, num_experts_per_worker=k, num_prefetch_experts=s) == []


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(dwdp_size=1, num_experts=8, num_experts_per_worker=8, num_prefetch_experts=8), "at least 2 ranks"),
        (dict(dwdp_size=3, num_experts=256, num_experts_per_worker=80, num_prefetch_experts=80), "coverage rule"),
        (dict(dwdp_size=2, num_experts=8, num_experts_per_worker=3, num_prefetch_experts=5), "stride must be <="),
        (dict(dwdp_size=2, num_experts=8, num_experts_per_worker=9, num_prefetch_experts=4), "must be in [1"),
        (dict(dwdp_size=4, num_experts=8, num_experts_per_worker=4, num_prefetch_experts=4), "hold nothing"),
        (dict(dwdp_size=2, num_experts=8, num_experts_per_worker=4, num_prefetch_experts=4, num_prefetch_slots=1),
         "num_prefetch_slots=1"),
        (dict(dwdp_size=2, num_experts=8, num_experts_per_worker=4, num_prefetch_experts=0), "must be >= 1"),
        (dict(dwdp_size=2, num_experts=8, num_experts_per_worker=4, num_prefetch_experts=4, num_groups=0), "num_groups"),
    ],
)
def test_invalid_configs_name_the_rule(kw, fragment):
    with pytest.raises(ValueError) as err:
        DwdpConfig(**kw)
    assert fragment in str(err.value)


def test_coverage_message_suggests_the_fix():
    with pytest.raises(ValueError) as err:
        DwdpConfig(dwdp_size=3, num_experts=256, num_experts_per_worker=80, num_prefetch_experts=80)
    assert "try num_experts_per_worker=86, num_prefetch_experts=85" in str(err.value)


def test_transfer_mode_checked():
    with pytest.raises(ValueError, match="transfer='nvlink'"):
        DwdpConfig(dwdp_size=2, num_experts=4, num_experts_per_worker=2, num_prefetch_experts=2, transfer="nvlink")


@pytest.mark.parametrize("r", [0, 5, -1])
def test_expert_replicas_out_of_range_explains_the_memory_cost(r):
    with pytest.raises(ValueError) as err:
        DwdpConfig(dwdp_size=4, num_experts=8, num_experts_per_worker=2, num_prefetch_experts=2, expert_replicas=r)
    msg = str(err.value)
    assert f"expert_replicas={r} must be in [1, dwdp_size=4]" in msg
    assert "r=1: up to 2 of 8 experts per rank, r=2: up to 4 of 8 experts per rank, r=4: up to 8 of 8" in msg


def test_expert_replicas_default_is_one_and_holders_follow_it():
    cfg = DwdpConfig(dwdp_size=4, num_experts=8, num_experts_per_worker=2, num_prefetch_experts=2)
    assert cfg.expert_replicas == 1 and cfg.holders().replicas == ((), (), (), ())
    cfg2 = DwdpConfig(dwdp_size=4, num_experts=8, num_experts_per_worker=2, num_prefetch_experts=2, expert_replicas=2)
    assert [cfg2.holders().stored_experts(i) for i in range(4)] == [4, 4, 4, 4]
