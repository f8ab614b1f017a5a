"""A dead rank is noticed by its peers within a bounded time, by name; losing rank 0 (the store host) too."""

from .group import run_group
from .workloads import monitored_rank


def test_dead_peer_is_named_within_bounded_time():
    res = run_group(monitored_rank, 3, victim=2)
    assert res[2] == ("died", 17)
    for r in (0, 1):
        status, out = res[r]
        assert status == "ok" and out["message"] and "rank 2" in out["message"], out
        assert 1.0 < out["after_s"] < 10.0  # death at 1 s, declared after ~1 s of silence (slack for load)


def test_losing_the_store_host_is_detected():
    res = run_group(monitored_rank, 3, victim=0)
    for r in (1, 2):
        status, out = res[r]
        assert status == "ok" and out["message"] and "lost the rendezvous store" in out["message"], out
        assert out["after_s"] < 10.0
