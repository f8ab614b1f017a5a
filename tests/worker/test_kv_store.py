"""KV store and block allocator: budget, TTL, claims, layout round trip (real tensors, no NIXL)."""

from __future__ import annotations

import threading

import pytest
import torch

from dwdp_worker.kv.blocks import BlockAllocator, DoubleFreeError, runs
from dwdp_worker.kv.layout import plan_for, read_stream
from dwdp_worker.kv.params import STREAM_ALIGN, AgentMessage, AgentOp, KvTransferParams
from dwdp_worker.kv.region import KvRegion
from dwdp_worker.kv.store import KvBudgetFull, KvStore, Refusal, Stale


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def kv_of(seq_len, layers=3, heads=2, kdim=8, vdim=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, heads, seq_len, kdim, generator=g).to(dtype),
             torch.randn(1, heads, seq_len, vdim, generator=g).to(dtype)) for _ in range(layers)]


def test_allocator_prefers_runs_never_overcommits_and_refuses_double_free():
    a = BlockAllocator(8)
    x, y = a.allocate(3), a.allocate(2)
    assert x == [0, 1, 2] and y == [3, 4]
    a.free(x)
    assert a.allocate(4) == [0, 1, 2, 5]           # fragmented: lowest free ids
    assert a.allocate(3) is None and a.num_free == 2  # never partial
    with pytest.raises(DoubleFreeError):
        a.free([0, 0])
    assert runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 1), (7, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_round_trips_every_tensor_aligned(dtype):
    kv = kv_of(5, dtype=dtype)
    descs, nbytes = plan_for(kv)
    assert [d.offset % STREAM_ALIGN for d in descs] == [0] * 6 and nbytes % STREAM_ALIGN == 0
    assert descs[1].shape == (1, 2, 5, 4) and descs[1].kind == "value" and descs[0].dtype == str(dtype)[6:]
    region = KvRegion(1 << 16, block_bytes=256)
    store = KvStore(region)
    e = store.put("r", kv, 5)
    back = read_stream(region.gather(e.block_ids)[:e.stream_bytes], e.descs)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv, back))


def test_fragmented_blocks_still_round_trip():
    region = KvRegion(64 * 256, block_bytes=256)
    store = KvStore(region)
    held = [store.put(f"f{i}", kv_of(1, layers=1, heads=1, kdim=16, vdim=16), 1) for i in range(64)]
    for e in held[::2]:                               # free every other block
        assert store.discard(e.request_id)
    kv = kv_of(7, layers=2)                          # needs several blocks: no run of them is free
    e = store.put("big", kv, 7)
    assert len(runs(e.block_ids)) > 1
    back = read_stream(region.gather(e.block_ids)[:e.stream_bytes], e.descs)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv, back))


def test_ttl_frees_unclaimed_and_counts_it_and_late_claims_say_expired_or_lapsed():
    clock = Clock()
    store = KvStore(KvRegion(1 << 16, block_bytes=1024), ttl_s=10, lease_s=15, grace_s=0, clock=clock)
    store.put("a", kv_of(4), 4)
    store.put("b", kv_of(4), 4)
    assert store.claim("b", "dec", "n1").entry is not None
    clock.t = 10.0
    assert store.sweep() == ["a"]                    # b is leased, not on the TTL any more
    assert store.claim("a", "dec", "n2").refusal is Refusal.EXPIRED
    assert store.claim("zz", "dec", "n3").refusal is Refusal.UNKNOWN
    assert store.claim("b", "other", "n4").refusal is Refusal.CLAIMED
    assert store.claim("b", "dec", "n5").refusal is Refusal.CLAIMED   # the same agent's second pull too
    again = store.claim("b", "dec", "n1")                             # the same pull asking again: not extended
    assert again.entry is not None and again.lease_s == pytest.approx(5.0)
    clock.t = 16.0                                   # the lease lapsed: the decode side died mid-pull
    assert store.sweep() == ["b"]
    assert store.claim("b", "dec", "n1").refusal is Refusal.LAPSED
    s = store.stats()
    assert (s.expirations_total, s.held_bytes, s.held_sequences, s.refusals_total) == (2, 0, 0, 5)


def test_confirm_inside_the_lease_is_valid_and_frees_at_once_only_for_the_claim_holder():
    clock = Clock()
    store = KvStore(KvRegion(1 << 16, block_bytes=1024), clock=clock)
    e = store.put("a", kv_of(4), 4)
    assert store.stats().held_bytes == len(e.block_ids) * 1024
    assert store.confirm("a", "dec", "n1") == store.confirm("a", "dec", "n1")  # not claimed yet: stale, untouched
    assert store.confirm("a", "dec", "n1").stale is Stale.NOT_CLAIMED
    claimed = store.claim("a", "dec", "n1")
    assert claimed.entry is e and claimed.lease_s == pytest.approx(store.lease_s)
    assert store.confirm("a", "dec", "wrong").stale is Stale.NOT_YOUR_CLAIM      # an old nonce: the claim stays
    assert store.confirm("a", "stranger", "n1").stale is Stale.NOT_YOUR_CLAIM
    assert not store.abort("a", "stranger", "n1")
    clock.t = 0.25
    assert store.confirm("a", "dec", "n1").valid
    s = store.stats()
    assert (s.pulls_total, s.held_bytes, s.pulled_bytes_total, s.stale_total) == (1, 0, e.stream_bytes, 5)
    assert s.pull_seconds_total == pytest.approx(0.25) and s.quarantined_bytes == 0   # valid: no grace needed
    assert store.claim("a", "dec", "n2").refusal is Refusal.PULLED
    assert store.confirm("a", "dec", "n1").stale is Stale.RELEASED                  # a second READ: stale
    with pytest.raises(ValueError, match="already stored"):
        store.put("b", kv_of(1), 1) and store.put("b", kv_of(1), 1)


def test_a_confirmation_after_the_lapse_is_stale_even_before_the_sweep():
    """The verdict uses the rank's clock at confirmation time, not the sweep's schedule."""
    clock = Clock()
    store = KvStore(KvRegion(1 << 16, block_bytes=1024), ttl_s=10, lease_s=2, grace_s=1, clock=clock)
    store.put("a", kv_of(4), 4)
    store.claim("a", "dec", "n1")
    clock.t = 1.999
    assert store.get("a") is not None
    clock.t = 2.0                                    # the lease ends here; no sweep has run
    assert store.confirm("a", "dec", "n1").stale is Stale.LAPSED
    assert store.confirm("a", "dec", "n1").stale is Stale.LAPSED   # and stays so
    assert store.confirm("a", "other", "n9").stale is Stale.NOT_YOUR_CLAIM
    s = store.stats()
    assert (s.pulls_total, s.expirations_total, s.stale_total) == (0, 1, 3)


def test_blocks_a_read_may_still_read_are_not_reused_during_the_grace_period():
    clock = Clock()
    region = KvRegion(2 * 1536, block_bytes=1536)    # room for exactly one 2-block sequence
    store = KvStore(region, ttl_s=10, lease_s=1, grace_s=3, clock=clock)
    kv = kv_of(12, layers=2, heads=2, kdim=8, vdim=8)  # 4 tensors × 768 B → 2 blocks of 1536 B
    old = store.put("old", kv, 12)
    store.claim("old", "dec", "n1")
    clock.t = 1.0
    assert store.sweep() == ["old"]                  # lapsed: into quarantine, not free
    s = store.stats()
    assert (s.held_bytes, s.quarantined_bytes, s.held_sequences) == (3072, 3072, 0)
    clock.t = 3.999
    with pytest.raises(KvBudgetFull, match="grace period"):
        store.put("new", kv, 12)
    clock.t = 4.0                                    # lapse + grace: the blocks may hold a new owner now
    new = store.put("new", kv_of(12, layers=2, heads=2, kdim=8, vdim=8, seed=9), 12)
    assert new.block_ids == old.block_ids and store.stats().quarantined_bytes == 0
    assert store.confirm("old", "dec", "n1").stale is Stale.LAPSED   # the late READ read the new owner's bytes
    assert store.get("new").state == "held"                        # …and the new owner is untouched
    assert store.claim("new", "dec2", "m").entry is new and store.confirm("new", "dec2", "m").valid


def test_an_abort_quarantines_and_a_discard_does_not():
    clock = Clock()
    store = KvStore(KvRegion(1 << 16, block_bytes=1024), grace_s=2, clock=clock)
    store.put("a", kv_of(4), 4)
    store.put("b", kv_of(4), 4)
    assert not store.discard("zz") and store.discard("b")
    store.claim("a", "dec", "n")
    assert not store.discard("a")                    # claimed: only its holder frees it
    assert store.abort("a", "dec", "n") and store.stats().quarantined_bytes > 0
    assert store.confirm("a", "dec", "n").stale is Stale.ABORTED
    assert store.claim("b", "dec", "n2").refusal is Refusal.DISCARDED
    clock.t = 2.0
    store.sweep()
    assert store.stats().held_bytes == 0


def test_allocator_quarantine_is_neither_free_nor_allocated():
    a = BlockAllocator(4)
    ids = a.allocate(2)
    a.quarantine(ids, until=5.0)
    assert (a.num_free, a.num_quarantined) == (2, 2)
    assert a.allocate(3) is None and a.allocate(2) == [2, 3]
    with pytest.raises(DoubleFreeError):
        a.free(ids)
    assert a.thaw(4.9) == 0 and a.thaw(5.0) == 2 and a.allocate(2) == ids


def test_budget_is_never_exceeded_under_100_concurrent_puts():
    region = KvRegion(40 * 1024, block_bytes=1024)   # room for 20 sequences of 2 blocks
    store = KvStore(region)
    kv = kv_of(12, layers=2, heads=2, kdim=8, vdim=8)  # 4 tensors × 768 B → 2 blocks
    peak, full, stop = [0], [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], store.stats().held_bytes)

    def request(i):
        try:
            store.put(f"r{i}", kv, 12)
            if i % 3 == 0:                            # some are pulled (and freed) at once
                store.claim(f"r{i}", "dec", "n")
                assert store.confirm(f"r{i}", "dec", "n").valid
        except KvBudgetFull as exc:
            assert "retry later" in str(exc)
            full[0] += 1

    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=request, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    w.join()
    s = store.stats()
    assert peak[0] <= region.capacity_bytes and s.held_bytes <= region.capacity_bytes
    assert full[0] > 0 and s.full_total == full[0] and s.stored_total == 100 - full[0]


def test_wire_models_refuse_unknown_fields():
    msg = AgentMessage(op=AgentOp.CLAIM, request_id="r", nonce="n", protocol="dwdp-kv/2", metadata="QUJD")
    assert AgentMessage.decode(msg.encode()) == msg
    with pytest.raises(ValueError):
        AgentMessage.decode(b'{"op": "claim", "request_id": "r", "typo": 1}')
    with pytest.raises(ValueError):
        KvTransferParams.model_validate({"remote_engine_id": "x"})


def test_region_refuses_a_budget_below_one_block():
    with pytest.raises(ValueError, match="smaller than one block"):
        KvRegion(100, block_bytes=1024)


def test_engine_requests_are_checked_before_any_forward():
    from dwdp_worker.rank.generation import KvDisabledError, check_requests
    from dwdp_worker.model.packing import BadBatchError

    assert check_requests([[1, 2]], None, None, max_positions=8, kv_enabled=False) == ([1], [None])
    with pytest.raises(KvDisabledError, match="KV transfer is off"):
        check_requests([[1, 2]], [1], ["r"], max_positions=8, kv_enabled=False)
    with pytest.raises(BadBatchError, match="max_position_embeddings=8"):
        check_requests([[1, 2, 3]], [7], None, max_positions=8, kv_enabled=True)
    with pytest.raises(BadBatchError, match="integer >= 1"):
        check_requests([[1]], [0], None, max_positions=8, kv_enabled=True)
    with pytest.raises(BadBatchError, match="one entry per sequence"):
        check_requests([[1], [2]], [1], None, max_positions=8, kv_enabled=True)


def test_region_memory_and_ucx_cuda_defaults_are_switches_with_clear_errors():
    from dwdp_worker.kv.nixl_api import apply_ucx_defaults
    from dwdp_worker.kv.region import RegionMemory, region_memory_from_env

    assert region_memory_from_env({}) is RegionMemory.CUDA_MALLOC
    assert region_memory_from_env({"DWDP_KV_REGION_MEMORY": "torch"}) is RegionMemory.TORCH
    with pytest.raises(ValueError, match="DWDP_KV_REGION_MEMORY='vmm': one of cuda_malloc, torch"):
        region_memory_from_env({"DWDP_KV_REGION_MEMORY": "vmm"})
    region = KvRegion(4096, block_bytes=1024, memory="cuda_malloc")   # a CPU rank: host memory either way
    assert region.buffer.device.type == "cpu" and region.mem == "DRAM"
    region.close()
    env = {}
    assert apply_ucx_defaults(env, cuda=True) == {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}
    assert apply_ucx_defaults({"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}, cuda=True) == \
        {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"}                   # the user's setting wins
    assert apply_ucx_defaults({}, cuda=False) == {}                  # no CUDA: UCX would warn of an unused variable
