"""The eager host gap of one prefill forward: the data issue #34's CUDA-graphs default decision needs (reports only).

Issue #34, item 3: turn CUDA graphs on by default for a bounded set of shapes, *or* show that the eager host gap
is ≤ 2 % and keep them off. For each ISL this times one unsharded forward of the ``bench/prefill.py`` model
(our experts, fused layers, bf16) two ways in one process:
  * ``wall``   — host wall time of ``Reference.logits`` from enqueue to the synchronised result;
  * ``kernels``— the sum of the GPU kernel durations of the same forward (``torch.profiler``: one stream, so
                  kernels do not overlap and the sum is the device's busy time);
and prints ``gap = 1 − kernels ÷ wall`` (the share of the forward the GPU waited on the host: what a graph
replay can remove) and the launches per forward. Goal for keeping graphs off: gap ≤ ``GAP_GOAL`` at the ISLs a
context server sees (1K–16K). The sharded engine adds the DWDP hooks' host work on top (their binds, events:
``bench/fp8_prefill.py --cuda-graphs`` measures that path with and without graphs). ``--fused-router`` adds the
same rows for the model with the fused router (``attach(fused_router=True)``): its effect on a whole prefill.
``--graphs`` adds, per row, the wall time of the same forward through ``PrefillGraphs`` (the worker's default:
padded to its ``graph_buckets`` shape, captured at its second forward, replayed after) and its speed-up over the
eager wall; an ISL off the ladder (``--isl 3000``) shows what the padding costs against the kernels it saves.

Run on a GPU:   python bench/host_gap.py [--isl 1024 4096 16384]
CPU smoke test: python bench/host_gap.py --device cpu --isl 64 --num-layers 2 --hidden-size 64 --num-experts 8
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

#: the eager host gap at or below which CUDA graphs stay off by default (issue #34)
GAP_GOAL = 0.02


def _kernel_us(prof, device_type: str) -> tuple[float, int]:
    """Σ device time of the profiled kernels (µs) and their number (CPU: the ops' self time, for the smoke run)."""
    total, count = 0.0, 0
    for evt in prof.events():
        if device_type == "cuda":
            if evt.device_type.name == "CUDA":  # a kernel / memcpy / memset: its interval on the device
                total += evt.time_range.elapsed_us()
                count += 1
        elif evt.cpu_parent is None:
            total += evt.self_cpu_time_total
            count += 1
    return total, count


def _timed(call, sync, iters: int) -> float:
    walls = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def graphs_wall(ref, seq, device, iters: int) -> dict:
    """Wall time of the forward replayed from its bucket's CUDA graph (warm-up and capture first)."""
    import torch

    from dwdp_runtime.graph_buckets import token_bucket
    from dwdp_worker.rank.prefill_graphs import PrefillGraphs

    graphs = PrefillGraphs(ref.model, device, max_graphs=1)
    try:
        for _ in range(3):
            graphs.logits([seq])
        wall = _timed(lambda: graphs.logits([seq]), lambda: torch.cuda.synchronize(device), iters)
        assert graphs.counters.captured == 1 and graphs.counters.failed == 0, graphs.counters
    finally:
        graphs.close()
    return dict(graphs_wall_ms=round(wall * 1e3, 3), bucket_tokens=token_bucket(len(seq)))


def measure(ref, seq, device, iters: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        ref.logits([seq])
    wall = _timed(lambda: ref.logits([seq]), sync, iters)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    kernels = []
    launches = 0
    for _ in range(3):
        with profile(activities=acts) as prof:
            ref.logits([seq])
            sync()
        us, launches = _kernel_us(prof, device.type)
        kernels.append(us / 1e6)
    busy = statistics.median(kernels)
    return dict(wall_ms=round(wall * 1e3, 3), kernels_ms=round(busy * 1e3, 3), gap=round(1.0 - busy / wall, 4),
                launches=launches)


def main(argv=None) -> int:
    from bench.prefill import ensure_model, parse_args as prefill_args

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--isl", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--fused-router", action="store_true",
                   help="also the same model with attach(fused_router=True): the router fusion's whole-prefill effect")
    p.add_argument("--graphs", action="store_true", help="also the forward replayed from its CUDA graph (CUDA only)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import torch

    from dwdp_worker.launch.oracle import Reference

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    rows = []
    model = prefill_args(["--isl", str(max(args.isl)), "--num-layers", str(args.num_layers), "--hidden-size",
                          str(args.hidden_size), "--num-experts", str(args.num_experts),
                          *(["--moe-intermediate-size", str(max(32, args.hidden_size // 2)), "--vocab-size", "512"]
                            if args.device == "cpu" else [])])
    model_dir = ensure_model(model)
    refs = {"model router": Reference(model_dir, device=device, experts="auto")}
    if args.fused_router:
        refs["fused router"] = Reference(model_dir, device=device, experts="auto", fused_router=True)
    gen = torch.Generator().manual_seed(0)
    for isl in args.isl:
        seq = torch.randint(0, model.vocab_size, (isl,), generator=gen).tolist()
        for name, ref in refs.items():
            r = dict(isl=isl, router=name, **measure(ref, seq, device, args.iters))
            if args.graphs and device.type == "cuda":
                r.update(graphs_wall(ref, seq, device, args.iters))
                r["graphs_speedup"] = round(r["wall_ms"] / r["graphs_wall_ms"], 3)
            rows.append(r)
            graphs = (f"; graph replay ({r['bucket_tokens']} tokens) {r['graphs_wall_ms']:.3f} ms = "
                      f"{r['graphs_speedup']:.2f}x eager" if "graphs_wall_ms" in r else "")
            print(f"ISL {isl:6d} {name}: wall {r['wall_ms']:9.3f} ms, kernels {r['kernels_ms']:9.3f} ms, host gap "
                  f"{r['gap']:+.1%} (graphs stay off if ≤ {GAP_GOAL:.0%}), {r['launches']} launches{graphs}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
