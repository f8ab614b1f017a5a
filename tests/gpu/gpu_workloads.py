"""Rank programs for the GPU tests (importable by spawned processes; CUDA is touched only inside).

``gpu_composite_program`` builds a real DWDP group on CUDA (posix_fd handles over Unix sockets, a
real TCPStore) and checks, per rank:
  1. bitwise: every composite equals the reference after every ``wait_and_bind``, many layers ×
     many forwards (host-synchronising checks: proves the bytes);
  2. ordering without host syncs: forwards where the copy stream is delayed before every layer's
     copies (RAW) and the compute stream sleeps after every bind before reading (WAR); the
     per-expert comparison runs on the compute stream and is checked only after the forward;
  3. ``torch._grouped_mm`` / ``F.grouped_mm`` on the composite == the same op on a plain tensor;
  4. steady state: forwards of bind/finish allocate nothing (caching-allocator counters and the
     backend's create/reserve/map counters unchanged) and never synchronize the device.
"""

from __future__ import annotations

import time


def reference(layer: int, name: str, num_experts: int, shape, dtype):
    import torch

    g = torch.Generator().manual_seed(layer * 131 + len(name) * 7 + 1)
    return torch.randn((num_experts, *shape), generator=g).to(dtype)


def _grouped_mm_checks(torch, composite, plain, device):
    """Return {"_grouped_mm": bool, "F.grouped_mm": bool|None} comparing composite vs plain bitwise."""
    import torch.nn.functional as F

    E, N, K = composite.shape
    g = torch.Generator(device="cpu").manual_seed(7)
    counts = torch.randint(0, 64, (E,), generator=g)
    counts[0] = 0  # an empty expert group must work too
    offs = torch.cumsum(counts, 0).to(torch.int32).to(device)
    x = torch.randn(int(counts.sum()), K, generator=g).to(composite.dtype).to(device)
    out = {}
    # mat_b is [E, K, N]: the transposed view of the [E, N, K] weight (docs/DRIVER_FACTS.md: works on the composite).
    a = torch._grouped_mm(x, composite.transpose(-2, -1), offs=offs)
    b = torch._grouped_mm(x, plain.transpose(-2, -1), offs=offs)
    out["_grouped_mm"] = bool(torch.equal(a, b))
    if hasattr(F, "grouped_mm"):
        a = F.grouped_mm(x, composite.transpose(-2, -1), offs=offs)
        b = F.grouped_mm(x, plain.transpose(-2, -1), offs=offs)
        out["F.grouped_mm"] = bool(torch.equal(a, b))
    else:
        out["F.grouped_mm"] = None
    return out


def gpu_composite_program(rank, world, port, *, num_experts, k, s, layers=8, forwards=4, race_forwards=3,
                          steady_forwards=6, shapes=None, transfer="copy_engine", contention_opt=False,
                          slots=2, devices=None, dtype_name="bfloat16", skip=None, token="gpu-t0k3n",
                          sleep_cycles=2_000_000, timeout_s=120.0):
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.manager import DwdpManager
    from dwdp_runtime.rendezvous import StoreRendezvous

    dev = torch.device("cuda", devices[rank] if devices else 0)
    torch.cuda.set_device(dev)
    dtype = getattr(torch, dtype_name)
    shapes = shapes or {"gate_up_proj": (256, 384), "down_proj": (384, 128)}
    cfg = DwdpConfig(dwdp_size=world, num_experts=num_experts, num_experts_per_worker=k,
                     num_prefetch_experts=s, num_prefetch_slots=slots, contention_opt=contention_opt,
                     transfer=transfer)
    rdzv = StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="gputest",
                           token=token, timeout_s=timeout_s)
    refs = {(l, n): reference(l, n, num_experts, shp, dtype).to(dev) for l in range(layers)
            for n, shp in shapes.items()}
    out = {"device": str(dev), "checks": 0}
    with rdzv, DwdpManager.create(config=cfg, rank=rank, rendezvous=rdzv, backend="posix_fd", device=dev,
                                  token=token) as mgr:
        a, b = mgr.local_range
        out["local_range"] = (a, b)
        out["backend"] = mgr.memory.name
        out["granularity"] = mgr.memory.granularity
        for l in range(layers):
            mgr.add_layer(l)
            for n in shapes:
                # A device tensor: the fill is an async D2D copy into the shareable allocation.
                mgr.add_expert_weight(l, n, expert_shape=shapes[n], dtype=dtype, fill=refs[(l, n)][a:b].clone())
        mgr.setup()
        streams = mgr.streams

        # 1. bitwise, host-synchronising
        for f in range(forwards):
            mgr.start_forward()
            for l in range(layers):
                if skip is not None and (f, l) == tuple(skip):
                    continue
                tensors = mgr.wait_and_bind(l)
                for n, t in tensors.items():
                    assert t.device == dev, f"composite on {t.device}, expected {dev}"
                    if not torch.equal(t, refs[(l, n)]):
                        bad = [e for e in range(num_experts) if not torch.equal(t[e], refs[(l, n)][e])]
                        raise AssertionError(f"rank {rank} forward {f} layer {l} {n}: experts {bad} differ")
                    out["checks"] += 1
                mgr.finish_layer(l)
        out["restarts"] = mgr.num_restarts

        # 2. ordering under delays, no host sync inside a forward
        real_enqueue = streams.enqueue_copies

        def delayed_enqueue(compiled):
            with torch.cuda.stream(streams.copy_stream):
                torch.cuda._sleep(sleep_cycles)  # RAW: copies land late; compute must wait for them
            real_enqueue(compiled)

        streams.enqueue_copies = delayed_enqueue
        try:
            for f in range(race_forwards):
                oks = []
                mgr.start_forward()
                for l in range(layers):
                    tensors = mgr.wait_and_bind(l)
                    if f % 2 == 1:
                        torch.cuda._sleep(sleep_cycles)  # WAR: the reader runs late; copies must not overtake
                    for n, t in tensors.items():
                        oks.append(((t == refs[(l, n)]).flatten(1).all(1), l, n))
                    mgr.finish_layer(l)
                torch.cuda.synchronize(dev)
                for ok, l, n in oks:
                    if not bool(ok.all()):
                        bad = torch.nonzero(~ok).flatten().tolist()
                        raise AssertionError(f"rank {rank} race forward {f} layer {l} {n}: experts {bad} "
                                             f"differ (stream ordering broken)")
                    out["checks"] += 1
        finally:
            streams.enqueue_copies = real_enqueue

        # 3. grouped_mm on the composite vs a plain tensor
        mgr.start_forward()
        gm = None
        for l in range(layers):
            tensors = mgr.wait_and_bind(l)
            if l == 0:
                gm = _grouped_mm_checks(torch, tensors["gate_up_proj"], refs[(0, "gate_up_proj")].clone(), dev)
            mgr.finish_layer(l)
        out["grouped_mm"] = gm

        # 4. steady state: no allocation, no synchronize
        torch.cuda.synchronize(dev)
        mem_before = dict(mgr.memory.stats)
        alloc_before = torch.cuda.memory_stats(dev).get("allocation.all.allocated", 0)
        seg_before = torch.cuda.memory_stats(dev).get("segment.all.allocated", 0)
        sync_before = streams.stats["synchronize"]
        bind_s = 0.0
        binds = 0
        t0 = time.perf_counter()
        for f in range(steady_forwards):
            mgr.start_forward()
            for l in range(layers):
                tb = time.perf_counter()
                mgr.wait_and_bind(l)
                bind_s += time.perf_counter() - tb
                binds += 1
                mgr.finish_layer(l)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize(dev)
        stats = torch.cuda.memory_stats(dev)
        out["steady"] = {
            "torch_allocations": stats.get("allocation.all.allocated", 0) - alloc_before,
            "torch_segments": stats.get("segment.all.allocated", 0) - seg_before,
            "backend_calls": {k2: mgr.memory.stats[k2] - mem_before[k2] for k2 in mem_before},
            "synchronize": streams.stats["synchronize"] - sync_before,
            "bind_us": 1e6 * bind_s / max(binds, 1),
            "host_us_per_layer": 1e6 * host_s / max(binds, 1),
        }
        # the bytes are still right after the steady loop
        mgr.start_forward()
        for l in range(layers):
            tensors = mgr.wait_and_bind(l)
            for n, t in tensors.items():
                if not torch.equal(t, refs[(l, n)]):
                    raise AssertionError(f"rank {rank} after steady state, layer {l} {n} differs")
                out["checks"] += 1
            mgr.finish_layer(l)
        out["stats"] = {k2: v for k2, v in mgr.stats().items() if isinstance(v, (int, float, str))}
        out["stream_stats"] = dict(streams.stats)
    return out
