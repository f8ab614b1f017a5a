"""DWDP_d vs DEP_d: iteration latency of the same MoE stack, measured side by side in one run.

    python bench/dwdp_vs_dep.py --backend cuda --d 4 --isl 2048 4096 8192 16384 32768 --cv 0 0.2 --out out/dvd
    python bench/dwdp_vs_dep.py --backend host --d 2 --isl 256 512 --layers 2 --hidden 64 --experts 8 \\
        --inter 32 --heads 4 --topk 2 --out out/cpu        # CPU smoke run: numbers mean nothing

Pipeline:
  1. for each d: spawn d rank processes (multiprocessing ``spawn``; no torchrun) that hold BOTH
     methods over the same seeded weights (``bench/moe_ranks.py``): a DEP process group
     (NCCL on GPU with ``NCCL_NVLS_ENABLE=0``, gloo on CPU; TCP store on loopback) and a DWDP
     manager (``--backend``: ``cuda`` = posix_fd handles on one node, ``host`` = memfd on CPU);
  2. for each (isl, cv) and iteration i: every rank draws the same per-rank lengths
     ``L_r = max(1, round(isl·(1 + cv·Z_r)))`` (Z_r standard normal, seeded by (seed, isl, cv, i)),
     builds its input, and runs one forward of each method (order alternating per iteration), each
     started after a barrier, timed on the host around a device synchronize;
  3. the parent turns per-rank times into iteration latencies, prints a table and writes
     ``dwdp_vs_dep.json`` and ``dwdp_vs_dep.png`` under ``--out``.

The metric (what a prefill batch costs on the group):
  * **T_DEP** = median over iterations of ``max over ranks`` of the rank's forward time. Every MoE
    layer's two all-to-alls make all ranks wait for the slowest one, so all ranks finish together
    and the max is the group's iteration latency (it already contains the sync waits).
  * **T_DWDP** = median over iterations of ``mean over ranks`` of the rank's own forward time. DWDP
    ranks never wait for each other: each serves its own sequences and is free when it is done,
    so a rank's request latency is its own time and the group's average latency is the mean
    (the max is recorded too, as ``dwdp_max_ms``).
  * **ratio** = T_DEP / T_DWDP (> 1: DWDP is faster), from the same run, same processes, same GPUs.
  * **plan** = ``dwdp plan``'s forward-time ratio for the same shapes, (k, s), isl, cv and d, on
    ``--plan-hardware`` (default h200-hgx); it models bf16 kernels at roofline, so only GPU rows
    are comparable with it. Shown when ``dwdp_runtime.planner`` is importable.

Caveats, stated so nobody reads more into a number than it holds:
  * CPU rows (``--backend host``) exercise the code path only; their times mean nothing.
  * With fewer GPUs than d, ranks would time-slice one GPU: refused unless ``--allow-shared-gpu``
    (a smoke run; its times mean nothing either).
  * DEP reads its counts exchange on the host once per layer (one sync per layer), as a DEP without
    worst-case preallocated buffers must; DWDP has no host sync in a forward.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("host", "cuda"), default=None,
                   help="DWDP memory backend and device: cuda (GPUs, NCCL) or host (CPU, gloo); "
                        "default cuda when a GPU is visible")
    p.add_argument("--d", type=int, nargs="+", default=[2, 4, 8], help="group sizes")
    p.add_argument("--isl", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768],
                   help="mean input length per rank (tokens)")
    p.add_argument("--cv", type=float, nargs="+", default=[0.0, 0.2],
                   help="coefficient of variation of per-rank lengths")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--inter", type=int, default=768, help="expert intermediate size I")
    p.add_argument("--dtype", default=None, help="bfloat16 (cuda default) or float32 (host default)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("auto", "grouped_mm", "loop"), default="auto",
                   help="grouped expert op (auto: grouped_mm on CUDA, loop on CPU)")
    p.add_argument("--allow-shared-gpu", action="store_true",
                   help="let d ranks share fewer GPUs (smoke test only: time-sliced, meaningless times)")
    p.add_argument("--plan-hardware", default="h200-hgx")
    p.add_argument("--kind", default=os.environ.get("DWDP_BENCH_KIND", ""),
                   help="machine kind for the table header (e.g. nvidia-h200-x4)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per group before giving up")
    p.add_argument("--out", default="out/dwdp_vs_dep")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="print the table and write the PNG from a dwdp_vs_dep.json of an earlier run "
                        "(e.g. fetched from a GPU machine without matplotlib), then exit")
    args = p.parse_args(argv)
    if args.backend is None:
        import torch
        args.backend = "cuda" if torch.cuda.is_available() else "host"
    if args.dtype is None:
        args.dtype = "bfloat16" if args.backend == "cuda" else "float32"
    return args


def planner_ratio(cfg, *, d: int, isl: int, cv: float, hardware: str) -> tuple[float | None, str]:
    """``dwdp plan``'s predicted T_DEP/T_DWDP (forward) for the same shapes, or (None, why)."""
    try:
        from dwdp_runtime.planner import plan
    except ImportError as exc:
        return None, f"planner not available ({exc})"
    from bench.dwdp_moe import dwdp_config

    c = dwdp_config(cfg, d)
    try:
        r = plan(model=cfg.hf_config(), dtype="bf16", hardware=hardware, isl=isl, cv=cv, dwdp_size=d,
                 experts_per_worker=c.num_experts_per_worker, prefetch_stride=c.num_prefetch_experts,
                 prefetch_slots=c.num_prefetch_slots, with_crossover=False, with_recommendation=False)
    except ValueError as exc:
        return None, str(exc).splitlines()[0]
    return r.forward["speedup"], ""


def summarise(times: dict[int, dict[str, list[float]]], key: str, d: int) -> dict[str, float]:
    """Per-iteration DEP max-over-ranks and DWDP mean/max-over-ranks, then medians (ms)."""
    dep = [max(times[r][f"{key}/dep"][i] for r in range(d)) for i in range(len(times[0][f"{key}/dep"]))]
    n = len(times[0][f"{key}/dwdp"])
    dwdp_mean = [statistics.fmean(times[r][f"{key}/dwdp"][i] for r in range(d)) for i in range(n)]
    dwdp_max = [max(times[r][f"{key}/dwdp"][i] for r in range(d)) for i in range(n)]
    t_dep, t_dwdp = statistics.median(dep) * 1e3, statistics.median(dwdp_mean) * 1e3
    return {"dep_ms": t_dep, "dwdp_ms": t_dwdp, "dwdp_max_ms": statistics.median(dwdp_max) * 1e3,
            "ratio": t_dep / t_dwdp,
            "ratio_per_iter_median": statistics.median(a / b for a, b in zip(dep, dwdp_mean))}


def table(rows: list[dict]) -> str:
    head = ("| d | isl | cv | T_DEP ms | T_DWDP ms (mean rank) | DWDP max rank ms | T_DEP/T_DWDP | "
            "plan T_DEP/T_DWDP |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        plan = f"{r['plan']:.3f}" if r.get("plan") is not None else "n/a"
        lines.append(f"| {r['d']} | {r['isl']} | {r['cv']:g} | {r['dep_ms']:.3f} | {r['dwdp_ms']:.3f} | "
                     f"{r['dwdp_max_ms']:.3f} | {r['ratio']:.3f} | {plan} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cvs = sorted({r["cv"] for r in rows})
    fig, axes = plt.subplots(1, len(cvs), figsize=(5.5 * len(cvs), 4), squeeze=False)
    for ax, cv in zip(axes[0], cvs):
        for d in sorted({r["d"] for r in rows}):
            sel = sorted((r for r in rows if r["d"] == d and r["cv"] == cv), key=lambda r: r["isl"])
            xs = [r["isl"] for r in sel]
            line, = ax.plot(xs, [r["ratio"] for r in sel], "o-", label=f"measured d={d}")
            if any(r.get("plan") is not None for r in sel):
                ax.plot([r["isl"] for r in sel if r.get("plan") is not None],
                        [r["plan"] for r in sel if r.get("plan") is not None], "--",
                        color=line.get_color(), alpha=0.7, label=f"dwdp plan d={d} (roofline, bf16)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input length per rank (tokens)")
        ax.set_ylabel("T_DEP / T_DWDP  (>1: DWDP faster)")
        ax.set_title(f"cv = {cv:g}")
        ax.legend(fontsize=8)
    import textwrap

    fig.suptitle("\n".join(textwrap.wrap(title, 140)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plot(rows: list[dict], out: str, header: str) -> None:
    try:
        plot(rows, os.path.join(out, "dwdp_vs_dep.png"), header.split("\n")[0])
        print(f"wrote {out}/dwdp_vs_dep.png")
    except ImportError as exc:   # the GPU images may lack matplotlib: --replot the JSON elsewhere
        print(f"PNG skipped ({exc}); run: python bench/dwdp_vs_dep.py --replot {out}/dwdp_vs_dep.json")


def replot(path: str, out: str) -> int:
    with open(path) as f:
        saved = json.load(f)
    print(saved["header"])
    print(table(saved["rows"]))
    os.makedirs(out, exist_ok=True)
    write_plot(saved["rows"], out, saved["header"])
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        return replot(args.replot, args.out)
    from bench.moe_ranks import bench_program
    from bench.moe_stack import StackConfig
    from tests.runtime.group import free_port, run_group

    cfg = StackConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, experts=args.experts,
                      topk=args.topk, inter=args.inter, seed=args.seed)
    os.environ["NCCL_NVLS_ENABLE"] = "0"   # inherited by the spawned ranks
    os.makedirs(args.out, exist_ok=True)
    grid = [(isl, cv) for isl in args.isl for cv in args.cv]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rows, raw, failed = [], {}, {}
    for d in args.d:
        t0 = time.monotonic()
        res = run_group(bench_program, d, harness_timeout_s=args.timeout, store_port=free_port(),
                        cfg_kw=cfg.__dict__, backend=args.backend, dtype_name=args.dtype, grid=grid,
                        iters=args.iters, warmup=args.warmup, seed=args.seed, impl=args.impl,
                        shared_gpu=args.allow_shared_gpu)
        bad = {r: v for r, v in res.items() if v[0] != "ok"}
        if bad:
            failed[d] = {r: str(v[1])[-2000:] for r, v in bad.items()}
            print(f"d={d}: FAILED on ranks {sorted(bad)}:\n" + next(iter(failed[d].values())), file=sys.stderr)
            continue
        times = {r: res[r][1]["times"] for r in range(d)}
        raw[d] = {"times": times, "lens": res[0][1]["lens"], "stats": {r: res[r][1]["stats"] for r in range(d)}}
        for isl, cv in grid:
            row = {"d": d, "isl": isl, "cv": cv, **summarise(times, f"{isl}/{cv}", d)}
            row["plan"], why = planner_ratio(cfg, d=d, isl=isl, cv=cv, hardware=args.plan_hardware)
            if why:
                row["plan_note"] = why
            rows.append(row)
        print(f"d={d}: {len(grid)} points in {time.monotonic() - t0:.1f} s "
              f"(impl={res[0][1]['stats']['impl']}, device={res[0][1]['stats']['device']})", file=sys.stderr)
    import torch

    header = (f"DWDP vs DEP — backend={args.backend} dtype={args.dtype} kind={args.kind or '?'} date={date} "
              f"torch={torch.__version__}; stack: layers={cfg.layers} hidden={cfg.hidden} heads={cfg.heads} "
              f"experts={cfg.experts} topk={cfg.topk} inter={cfg.inter}; iters={args.iters} "
              f"warmup={args.warmup} seed={args.seed}")
    if args.backend == "host" or args.allow_shared_gpu:
        header += "\nNOTE: CPU / shared-GPU run — exercises the code path; the times are NOT performance numbers."
    print(header)
    if rows:
        print(table(rows))
        notes = {r.get("plan_note") for r in rows if r.get("plan_note")}
        for n in notes:
            print(f"plan: {n}")
        write_plot(rows, args.out, header)
    with open(os.path.join(args.out, "dwdp_vs_dep.json"), "w") as f:
        json.dump({"header": header, "args": vars(args), "rows": rows, "failed": failed,
                   "raw": {str(d): v for d, v in raw.items()}}, f, indent=1, default=str)
    print(f"wrote {args.out}/dwdp_vs_dep.json")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
