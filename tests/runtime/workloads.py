"""Rank programs for the multi-process runtime tests (importable by spawned processes)."""

from __future__ import annotations

import os
import time


def reference(layer: int, name: str, num_experts: int, shape, dtype):
    """Deterministic expert weights: every rank computes the same reference without communication."""
    import torch

    g = torch.Generator().manual_seed(layer * 131 + len(name))
    return torch.randn((num_experts, *shape), generator=g).to(dtype)


def composite_program(rank, world, port, *, num_experts, k, s, layers=4, forwards=3, shapes=None,
                      granularity=4096, slots=2, contention_opt=False, copy_delay_s=0.0,
                      skip=None, dtype_name="float32", page_multiplier=8, token="t0k3n", timeout_s=60.0):
    """Build composites for ``layers`` MoE layers and check them bitwise after every wait_and_bind."""
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.manager import DwdpManager
    from dwdp_runtime.rendezvous import StoreRendezvous

    dtype = getattr(torch, dtype_name)
    shapes = shapes or {"gate_up_proj": (6, 5), "down_proj": (5, 3)}
    cfg = DwdpConfig(dwdp_size=world, num_experts=num_experts, num_experts_per_worker=k,
                     num_prefetch_experts=s, num_prefetch_slots=slots, contention_opt=contention_opt)
    rdzv = StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="test",
                           token=token, timeout_s=timeout_s)
    refs = {(l, n): reference(l, n, num_experts, shp, dtype) for l in range(layers) for n, shp in shapes.items()}
    checks = 0
    with rdzv, DwdpManager.create(config=cfg, rank=rank, rendezvous=rdzv, backend="host",
                                  granularity=granularity, token=token, copy_delay_s=copy_delay_s,
                                  page_multiplier=page_multiplier) as mgr:
        a, b = mgr.local_range
        for l in range(layers):
            mgr.add_layer(l)
            for n, shp in shapes.items():
                mgr.add_expert_weight(l, n, expert_shape=shp, dtype=dtype, fill=refs[(l, n)][a:b].clone())
        mgr.setup()
        creates = dict(mgr.memory.stats)
        syncs_at_setup = mgr.streams.stats["synchronize"]
        for f in range(forwards):
            mgr.start_forward()
            for l in range(layers):
                if skip is not None and (f, l) == tuple(skip):
                    continue
                tensors = mgr.wait_and_bind(l)
                for n, t in tensors.items():
                    if not torch.equal(t, refs[(l, n)]):
                        bad = [e for e in range(num_experts) if not torch.equal(t[e], refs[(l, n)][e])]
                        raise AssertionError(f"rank {rank} forward {f} layer {l} {n}: experts {bad} differ")
                    checks += 1
                mgr.finish_layer(l)
        stats = mgr.stats()
        stats["allocations_after_setup"] = {k2: mgr.memory.stats[k2] - creates[k2] for k2 in creates}
        stats["checks"] = checks
        stats["local_range"] = (a, b)
        stats["steady_syncs"] = mgr.streams.stats["synchronize"] - syncs_at_setup
        stats["copy_wait_s"] = mgr.streams.stats["wait_s"]
    return stats


def die_after_join(rank, world, port, *, victim, token="t0k3n", timeout_s=5.0, **kw):
    """Every rank joins; ``victim`` dies right after joining; the others try to set up a manager."""
    if rank == victim:
        from dwdp_runtime.rendezvous import StoreRendezvous

        StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="test", token=token,
                        timeout_s=timeout_s)
        time.sleep(0.5)
        os._exit(17)
    return composite_program(rank, world, port, token=token, timeout_s=timeout_s, **kw)


def monitored_rank(rank, world, port, *, victim, token="t0k3n", die_after_s=1.0, wait_s=20.0):
    """Ranks heart-beat through the store; ``victim`` dies; the survivors report how they noticed."""
    from dwdp_runtime.monitor import PeerLost, PeerMonitor
    from dwdp_runtime.rendezvous import StoreRendezvous

    rdzv = StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="mon", token=token,
                           timeout_s=10)
    rdzv.barrier("joined")
    # 3 s of silence, not 1: a live survivor's beat thread starved for a second on a loaded 2-core machine
    # must not read as a death (the tests bound the detection at 10 s)
    mon = PeerMonitor(rdzv, interval_s=0.2, dead_after_s=3.0).start()
    t0 = time.monotonic()
    if rank == victim:
        time.sleep(die_after_s)
        os._exit(17)
    deadline = t0 + wait_s
    out = {"message": None}
    while time.monotonic() < deadline:
        try:
            mon.check()
        except PeerLost as exc:
            out = {"message": str(exc), "after_s": time.monotonic() - t0}
            break
        time.sleep(0.05)
    survivors = [r for r in range(world) if r not in (victim, 0)]
    if rank == 0 and out["message"]:
        # rank 0 hosts the store: keep it up until the other survivors noticed on their own,
        # or they would (correctly, but not what this test checks) report the lost store instead
        stop = time.monotonic() + 10
        while time.monotonic() < stop and not all(rdzv.store_get_nowait(f"noticed/{r}") for r in survivors):
            time.sleep(0.05)
    elif rank != 0 and out["message"]:
        try:
            rdzv.store_set(f"noticed/{rank}", b"1")
        except Exception:  # noqa: BLE001 - the store host may be the victim
            pass
    mon.stop()
    return out
