"""A dead rank is noticed by its peers within a bounded time, by name; losing rank 0 (the store host) too."""

from .group import run_group
from .workloads import monitored_rank


def test_dead_peer_is_named_within_bounded_time():
    res = run_group(monitored_rank, 3, victim=2)
    assert res[2] == ("died", 17)
    for r in (0, 1):
        status, out = res[r]
        assert status == "ok" and out["message"] and "rank 2" in out["message"], out
        assert 1.0 < out["after_s"] < 10.0  # death at 1 s, declared after ~3 s of silence (slack for load)


def test_losing_the_store_host_is_detected():
    res = run_group(monitored_rank, 3, victim=0)
    for r in (1, 2):
        status, out = res[r]
        assert status == "ok" and out["message"] and "lost the rendezvous store" in out["message"], out
        assert out["after_s"] < 10.0


def test_the_verdict_names_a_silent_store_a_silent_peer_and_a_lost_connection():
    """The watch thread's whole judgement (pure): it never needs the store to answer."""
    from dwdp_runtime.monitor import Observations, verdict

    where = "group 0 attempt 0 (store h:1)"
    fresh = Observations(started=0.0, last_round=99.5, peers={1: (7, 99.0), 2: (3, 95.0)})
    assert verdict(fresh, 100.0, dead_after_s=10.0, where=where) is None
    # the store completed no round for 10 s (a frozen host: the beat thread is stuck in a call)
    frozen = Observations(started=0.0, last_round=89.0, peers={1: (7, 89.0)})
    assert "has not answered for 11.0 s" in verdict(frozen, 100.0, dead_after_s=10.0, where=where)
    # the store answers but peer 2's counter has not moved for 10 s
    silent = Observations(started=0.0, last_round=99.9, peers={1: (7, 99.0), 2: (3, 89.5)})
    assert "rank 2 of group 0" in verdict(silent, 100.0, dead_after_s=10.0, where=where)
    # a frozen store host: the last round (89.9) saw the host's counter unchanged since 89.0; 10.5 s later the
    # silence is the store's, not a peer's — the store is named, not "rank 0 stopped heart-beating"
    host_frozen = Observations(started=0.0, last_round=89.9, peers={0: (7, 89.0)})
    assert "has not answered" in verdict(host_frozen, 99.95, dead_after_s=10.0, where=where)
    assert verdict(host_frozen, 99.5, dead_after_s=10.0, where=where) is None  # neither bound crossed yet
    lost = Observations(started=0.0, last_round=99.9, store_error="Connection reset by peer")
    assert "lost the rendezvous store" in verdict(lost, 100.0, dead_after_s=10.0, where=where)
