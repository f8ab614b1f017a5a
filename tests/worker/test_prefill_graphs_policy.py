"""BucketPolicy (worker/dwdp_worker/rank/prefill_graphs.py): which way each prefill forward runs, on the host alone."""

import pytest

from dwdp_worker.rank.prefill_graphs import WARMUP_FORWARDS, Bucket, BucketPolicy, Mode, PrefillGraphs


def _run(policy: BucketPolicy, bucket: Bucket, *, capture_ok: bool = True) -> Mode:
    """One forward as PrefillGraphs drives the policy."""
    mode = policy.decide(bucket)
    if mode is Mode.CAPTURE:
        (policy.captured if capture_ok else policy.capture_failed)(bucket)
    if mode is Mode.EAGER or (mode is Mode.CAPTURE and not capture_ok):
        policy.ran_eager(bucket)
    return mode


def test_a_bucket_runs_eagerly_then_is_captured_then_replays():
    policy, b = BucketPolicy(max_graphs=2), Bucket(tokens=8192, sequences=1)
    modes = [_run(policy, b) for _ in range(WARMUP_FORWARDS + 4)]
    assert modes == [Mode.EAGER] * WARMUP_FORWARDS + [Mode.CAPTURE] + [Mode.REPLAY] * 3
    assert policy.num_captured == 1


def test_buckets_differ_by_tokens_and_by_sequences():
    policy = BucketPolicy(max_graphs=4)
    a, b = Bucket(100, 1), Bucket(100, 2)
    for _ in range(WARMUP_FORWARDS):
        assert _run(policy, a) is Mode.EAGER
    assert _run(policy, b) is Mode.EAGER  # a's warm-up does not count for b
    assert _run(policy, a) is Mode.CAPTURE


def test_past_max_graphs_new_buckets_stay_eager_and_captured_ones_keep_replaying():
    policy = BucketPolicy(max_graphs=1)
    first, second = Bucket(64, 1), Bucket(128, 1)
    for _ in range(WARMUP_FORWARDS + 1):
        _run(policy, first)
    assert [_run(policy, second) for _ in range(WARMUP_FORWARDS + 3)] == [Mode.EAGER] * (WARMUP_FORWARDS + 3)
    assert _run(policy, first) is Mode.REPLAY


def test_a_failed_capture_leaves_its_bucket_eager_for_good_and_frees_its_place():
    policy = BucketPolicy(max_graphs=1)
    bad, good = Bucket(64, 3), Bucket(64, 1)
    modes = [_run(policy, bad, capture_ok=False) for _ in range(WARMUP_FORWARDS + 3)]
    assert modes == [Mode.EAGER] * WARMUP_FORWARDS + [Mode.CAPTURE] + [Mode.EAGER] * 2
    assert policy.num_captured == 0
    for _ in range(WARMUP_FORWARDS):
        _run(policy, good)
    assert _run(policy, good) is Mode.CAPTURE  # the failed one took no graph's place


def test_zero_graphs_is_always_eager_and_negative_is_refused():
    policy, b = BucketPolicy(max_graphs=0), Bucket(8, 1)
    assert {_run(policy, b) for _ in range(5)} == {Mode.EAGER}
    with pytest.raises(ValueError, match="max_graphs=-1"):
        BucketPolicy(max_graphs=-1)


def test_prefill_graphs_refuse_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PrefillGraphs(model=None, device="cpu", max_graphs=1)


def test_after_max_failed_captures_no_new_bucket_is_tried_but_captured_ones_replay():
    from dwdp_worker.rank.prefill_graphs import MAX_FAILED_CAPTURES

    policy = BucketPolicy(max_graphs=8)
    good = Bucket(32, 1)
    for _ in range(WARMUP_FORWARDS + 1):
        _run(policy, good)
    for n in range(MAX_FAILED_CAPTURES):
        bad = Bucket(64 * (n + 1), 1)
        assert [_run(policy, bad, capture_ok=False) for _ in range(WARMUP_FORWARDS + 1)][-1] is Mode.CAPTURE
    fresh = Bucket(4096, 1)
    assert not policy.may_capture(fresh)
    assert {_run(policy, fresh) for _ in range(WARMUP_FORWARDS + 3)} == {Mode.EAGER}
    assert _run(policy, good) is Mode.REPLAY and policy.may_capture(good)
