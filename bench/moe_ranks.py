"""Rank programs: one process per rank holds BOTH methods (a DEP process group and a DWDP manager)
over the same seeded weights, so DWDP and DEP run the same model and inputs side by side.

``rank(rank, world, port, ...)`` signatures follow ``tests/runtime/group.run_group``: ``port`` is the
DEP process group's TCP store (``init_process_group``), ``store_port`` the DWDP rendezvous store;
both on loopback, no torchrun.

  * ``correctness_program`` — run a few steps of both methods, return their outputs (CPU tensors)
    and counters; the test compares them with ``moe_stack.reference_forward``.
  * ``bench_program`` — timed iterations per (isl, cv); see ``bench/dwdp_vs_dep.py`` for the metric.

Invariant: the two methods never run at the same time (a barrier separates every timed forward),
and they alternate which goes first each iteration, so neither always inherits a warm cache.
"""

from __future__ import annotations

import contextlib
import os
import random
import time

import torch
import torch.distributed as dist

from .dep_baseline import DepMoE
from .dwdp_moe import DwdpMoE, build_manager
from .ranks import sync_device
from .moe_stack import StackConfig, dense_weights, forward, grouped_impl, make_inputs


def draw_lengths(isl: int, cv: float, d: int, *, seed: int, step: int) -> list[int]:
    """Per-rank sequence lengths ``max(1, round(isl·(1 + cv·Z_r)))``, Z_r i.i.d. standard normal
    (the distribution ``dwdp plan`` integrates over); the same list on every rank and method."""
    rng = random.Random(f"{seed}/{isl}/{cv}/{step}")
    return [max(1, round(isl * (1.0 + cv * rng.gauss(0.0, 1.0)))) for _ in range(d)]


@contextlib.contextmanager
def both_methods(rank: int, world: int, port: int, *, store_port: int, cfg: StackConfig, backend: str,
                 dtype: torch.dtype, impl: str = "auto", token: str = "dwdp-vs-dep", shared_gpu: bool = False,
                 timeout_s: float = 300.0, threads: int | None = None):
    """Yield ``(env, dense, dep_moe, dwdp_moe)`` with everything set up; tear down on exit.

    On CPU each rank gets ``threads`` intra-op threads (default: its share of the cores). The thread
    count changes the BLAS blocking and so the float32 rounding: a bitwise comparison must run the
    reference with the same count."""
    from datetime import timedelta

    from dwdp_runtime.rendezvous import StoreRendezvous

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast stays off on the lent machines
    if backend == "host":
        device = torch.device("cpu")
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world))
    else:
        ngpu = torch.cuda.device_count()
        if ngpu < world and not shared_gpu:
            raise RuntimeError(f"d={world} needs {world} GPUs, {ngpu} visible (use nvidia-h200-x{world}, "
                               f"or --allow-shared-gpu for a smoke run whose timings mean nothing)")
        device = torch.device("cuda", rank % ngpu)
        torch.cuda.set_device(device)
        torch.empty(1, device=device)                 # torch's primary context first (docs/DRIVER_FACTS.md)
    impl = grouped_impl(device, impl)
    with contextlib.ExitStack() as stack:
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), **kw)
        stack.callback(dist.destroy_process_group)
        rdzv = stack.enter_context(StoreRendezvous(host="127.0.0.1", port=store_port, rank=rank,
                                                   world_size=world, job="dwdp-vs-dep", token=token,
                                                   timeout_s=timeout_s))
        mgr = stack.enter_context(build_manager(cfg, rank=rank, world=world, rendezvous=rdzv,
                                                backend=backend, device=device, dtype=dtype, token=token))
        dense = [dense_weights(cfg, l, device=device, dtype=dtype) for l in range(cfg.layers)]
        dep = DepMoE(cfg, rank=rank, world=world, device=device, dtype=dtype, impl=impl)
        env = {"device": device, "impl": impl, "mgr": mgr, "dwdp_range": mgr.local_range,
               "dep_range": (dep.lo, dep.hi)}
        yield env, dense, dep, DwdpMoE(mgr, impl)
        dist.barrier()   # nobody unmaps while a peer may still read its experts


def run_dep(cfg, dense, dep, x, seqlens):
    return forward(cfg, dense, x, seqlens, dep)


def run_dwdp(cfg, dense, dwdp, x, seqlens):
    dwdp.start_forward()
    return forward(cfg, dense, x, seqlens, dwdp)


def correctness_program(rank, world, port, *, store_port, cfg_kw, seqlens, steps=2, dtype_name="float32",
                        threads=1, backend="host", impl="auto"):
    """``seqlens[rank]``: this rank's packed sequence lengths. Returns outputs of every step as float32
    numpy arrays (a torch tensor would cross the queue as shared memory that dies with this process)."""
    cfg, dtype = StackConfig(**cfg_kw), getattr(torch, dtype_name)
    out = {"dep": [], "dwdp": []}
    with both_methods(rank, world, port, store_port=store_port, cfg=cfg, backend=backend, dtype=dtype,
                      impl=impl, timeout_s=60, threads=threads) as (env, dense, dep, dwdp):
        for step in range(steps):
            x = make_inputs(cfg, seqlens[rank], rank=rank, step=step, device=env["device"], dtype=dtype)
            for name, y in (("dep", run_dep(cfg, dense, dep, x, seqlens[rank])),
                            ("dwdp", run_dwdp(cfg, dense, dwdp, x, seqlens[rank]))):
                out[name].append(y.float().cpu().numpy())
        out["dep_stats"] = dict(dep.stats)
        out["dwdp_stats"] = env["mgr"].stats()
        out["dwdp_range"], out["dep_range"] = env["dwdp_range"], env["dep_range"]
        out["impl"], out["device"] = env["impl"], str(env["device"])
    return out


def bench_program(rank, world, port, *, store_port, cfg_kw, backend, dtype_name, grid, iters, warmup,
                  seed=0, impl="auto", shared_gpu=False):
    """Seconds per forward, per (isl, cv, method), one entry per timed iteration (this rank)."""
    cfg, dtype = StackConfig(**cfg_kw), getattr(torch, dtype_name)
    times: dict[str, list[float]] = {}
    lens: dict[str, list[list[int]]] = {}
    with both_methods(rank, world, port, store_port=store_port, cfg=cfg, backend=backend, dtype=dtype,
                      impl=impl, shared_gpu=shared_gpu) as (env, dense, dep, dwdp):
        device = env["device"]
        methods = {"dep": lambda x, s: run_dep(cfg, dense, dep, x, s),
                   "dwdp": lambda x, s: run_dwdp(cfg, dense, dwdp, x, s)}
        for isl, cv in grid:
            key = f"{isl}/{cv}"
            lens[key] = []
            for it in range(warmup + iters):
                all_lens = draw_lengths(isl, cv, world, seed=seed, step=it)
                x = make_inputs(cfg, [all_lens[rank]], rank=rank, step=it, device=device, dtype=dtype)
                order = ("dep", "dwdp") if it % 2 == 0 else ("dwdp", "dep")
                for name in order:
                    sync_device(device)
                    dist.barrier()
                    t0 = time.perf_counter()
                    methods[name](x, [all_lens[rank]])
                    sync_device(device)
                    dt = time.perf_counter() - t0
                    if it >= warmup:
                        times.setdefault(f"{key}/{name}", []).append(dt)
                if it >= warmup:
                    lens[key].append(all_lens)
        stats = {"impl": env["impl"], "device": str(device), "dwdp": env["mgr"].stats(), "dep": dict(dep.stats)}
    return {"times": times, "lens": lens, "stats": stats}
