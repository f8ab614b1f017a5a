"""Real multi-process DWDP groups on the host backend: composites bitwise equal to the reference
after every wait_and_bind, over many layers and forwards (tests/runtime/workloads.py)."""


from .group import run_group
from .workloads import composite_program, die_after_join

BIG = {"gate_up_proj": (30, 25), "down_proj": (25, 15)}  # 3000 B and 1500 B experts: not page multiples


def _ok(results):
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, bad
    return {r: v[1] for r, v in results.items()}


def test_three_ranks_overlapping_ranges_many_layers_and_forwards():
    # N=13, k=5, s=4: ranges [0,5) [4,9) [8,13) overlap by one expert
    out = _ok(run_group(composite_program, 3, num_experts=13, k=5, s=4, layers=5, forwards=4, shapes=BIG,
                        page_multiplier=1))
    for r, st in out.items():
        assert st["checks"] == 5 * 4 * 2
        assert st["restarts"] == 0 and st["steady_syncs"] == 0
        assert st["allocations_after_setup"] == {"create": 0, "reserve": 0, "map": 0}
        assert st["prefetch_bytes"] > 0  # the pool was really used
    assert [out[r]["local_range"] for r in range(3)] == [(0, 5), (4, 9), (8, 13)]


def test_four_ranks_uneven_bf16_contention_opt_four_slots():
    # N=10 over d=4 (not divisible): ranges [0,3) [3,6) [6,9) [9,10)
    out = _ok(run_group(composite_program, 4, num_experts=10, k=3, s=3, layers=6, forwards=3, shapes=BIG,
                        dtype_name="bfloat16", slots=4, contention_opt=True, page_multiplier=2))
    assert all(st["checks"] == 6 * 3 * 2 and st["restarts"] == 0 for st in out.values())
    # only remote bytes move: 3 forwards × 6 layers, plus the 4 layers (slots) of the next forward
    # already prefetched ahead; every layer has the same remote bytes
    for r, st in out.items():
        per_layer = st["remote_bytes_per_forward"] // 6
        assert st["prefetch_bytes"] == (3 * 6 + 4) * per_layer


def test_slow_copy_thread_never_exposes_stale_weights():
    out = _ok(run_group(composite_program, 3, num_experts=13, k=5, s=4, layers=4, forwards=3, shapes=BIG,
                        page_multiplier=1, copy_delay_s=0.03))
    assert all(st["checks"] == 4 * 3 * 2 for st in out.values())
    assert max(st["copy_wait_s"] for st in out.values()) > 0.02  # compute really waited on the events


def test_skipped_layer_restarts_and_stays_correct():
    out = _ok(run_group(composite_program, 2, num_experts=8, k=4, s=4, layers=4, forwards=4, shapes=BIG,
                        page_multiplier=1, skip=(1, 2)))
    assert all(st["restarts"] == 1 and st["checks"] == (4 * 4 - 1) * 2 for st in out.values())


def test_missing_rank_times_out_naming_it():
    res = run_group(composite_program, 3, ranks=[0, 1], num_experts=6, k=3, s=2, timeout_s=3)
    for r in (0, 1):
        status, text = res[r]
        assert status == "error" and "rank(s) [2] never arrived" in text, text


def test_killed_peer_is_detected_by_name():
    res = run_group(die_after_join, 3, victim=2, num_experts=6, k=3, s=2, shapes=BIG, timeout_s=4)
    assert res[2] == ("died", 17)
    for r in (0, 1):
        status, text = res[r]
        assert status == "error" and "RendezvousTimeout" in text and "rank(s) [2] never arrived" in text


def test_a_captured_forward_waits_only_on_its_own_events_and_stays_bitwise():
    # forward 1 of 4 runs as a CUDA-graph capture would (tests/runtime/workloads.py: CaptureCheckingStreams raises
    # on any wait inside it on an event recorded before it); a slow copy thread makes a missed ordering visible
    out = _ok(run_group(composite_program, 2, num_experts=8, k=4, s=4, layers=4, forwards=4, shapes=BIG,
                        page_multiplier=1, copy_delay_s=0.01, capture_at=1))
    for st in out.values():
        assert st["checks"] == (4 + 1) * 4 * 2  # every forward's composites bitwise, the captured one too
        # no restart around the capture; two after the refused one below: its out-of-order bind, and the next
        # forward's start (the invalidated schedule is left at that order, mid-sequence)
        assert st["captures"] == 1 and st["restarts"] == 2
        # the first two layers' copies were issued by forward 0 (2 slots): their binds' waits are skipped, and
        # join_copies before the capture is what orders them
        assert st["capture_skipped_waits"] == 2
        assert st["capture_waits"] > 0  # the copy stream joined the capture and was joined back
        mid, restart, after = st["refusals"]
        assert "mid-sequence" in mid
        assert "restarted during a CUDA-graph capture" in restart
        assert after == "capturing afterwards: False"
