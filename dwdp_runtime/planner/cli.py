"""The ``dwdp plan`` subcommand: argument parsing and error handling around ``plan()``.

Contract: ``--json`` prints exactly one JSON object on stdout; without it a table for people.
Bad input (unknown preset, bad or missing config.json, invalid sharding, bad numbers) prints one
line ``dwdp plan: error: <why>`` on stderr and exits 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..config import DEFAULT_PREFETCH_SLOTS, MIN_PREFETCH_SLOTS
from ..contract import FP4_KERNELS, Fp4Kernel
from . import presets
from .sweep import DEFAULT_BATCHES

EXIT_BAD_INPUT = 2


def add_subparser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="roofline planner: DWDP vs DEP, memory, recommended sharding",
                       description="Predict DWDP vs DEP per MoE layer with a per-operator roofline "
                                   "(see docs/PLANNER.md).")
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(sorted(presets.MODELS))}) or path to a HF config.json / its folder")
    p.add_argument("--dtype", default="bf16", help=f"expert weight dtype: {', '.join(presets.DTYPES)}")
    p.add_argument("--dense-dtype", default=None, help="dtype of attention/dense linears (default: --dtype)")
    p.add_argument("--fp4-kernel", default=Fp4Kernel.AUTO.value, choices=FP4_KERNELS,
                   help="the workers' DWDP_FP4_KERNEL, for nvfp4/mxfp4 experts (default auto: W4A8, which holds "
                        "one MoE layer's experts in e4m3 while it runs, in chunks of at most 1 GiB: the "
                        "w4a8_scratch part)")
    p.add_argument("--hardware", default="h200-hgx", help=f"GPU preset: {', '.join(presets.HARDWARE)}")
    p.add_argument("--isl", type=int, default=8192, help="input length per sequence (tokens)")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per forward")
    p.add_argument("--cv", type=float, default=0.0, help="coefficient of variation of per-rank lengths")
    p.add_argument("--dwdp-size", type=int, default=4, help="ranks per DWDP group (d)")
    p.add_argument("--experts-per-worker", type=int, default=None, help="k (default: suggest_sharding)")
    p.add_argument("--prefetch-stride", type=int, default=None, help="s (default: suggest_sharding)")
    p.add_argument("--prefetch-slots", type=int, default=DEFAULT_PREFETCH_SLOTS,
                   help=f"pool slots (>= {MIN_PREFETCH_SLOTS})")
    p.add_argument("--contention-opt", action="store_true", help="round-robin 2 MiB slicing across peers")
    p.add_argument("--expert-replicas", type=int, default=1,
                   help="r: every expert on >= r ranks (spare copies for a rank loss; memory part replica_experts)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sweep", nargs="?", const="dwdp-plan-sweep.png", default=None, metavar="PNG",
                   help="also write the Figure-3-style PNG (default path dwdp-plan-sweep.png)")
    p.add_argument("--sweep-batches", default=",".join(map(str, DEFAULT_BATCHES)),
                   help="batch sizes of the sweep curves (comma-separated; default %(default)s)")
    p.add_argument("--calibrate", nargs="?", const="-", default=None, metavar="MEASURED_JSON",
                   help="compare measured times with predictions (no file: the H200 figures of docs/DRIVER_FACTS.md)")
    p.set_defaults(func=run)
    return p


def _fail(msg: str) -> int:
    print(f"dwdp plan: error: {msg}", file=sys.stderr)
    return EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    from .calibration import H200_MEASURED, calibrate, format_report
    from .model_shapes import ModelConfigError
    from .evaluator import Evaluator
    from .plan import plan

    try:
        if args.calibrate is not None:
            if args.calibrate == "-":
                measured = H200_MEASURED
            else:
                with open(args.calibrate, encoding="utf-8") as f:
                    measured = json.load(f)
            res = calibrate(measured)
            print(json.dumps(res) if args.json else format_report(res))
            return 0
        result = plan(model=args.model, dtype=args.dtype, dense_dtype=args.dense_dtype, hardware=args.hardware,
                      isl=args.isl, batch=args.batch, cv=args.cv, dwdp_size=args.dwdp_size,
                      experts_per_worker=args.experts_per_worker, prefetch_stride=args.prefetch_stride,
                      prefetch_slots=args.prefetch_slots, contention_opt=args.contention_opt,
                      expert_replicas=args.expert_replicas, fp4_kernel=args.fp4_kernel)
        if args.sweep:
            from .sweep import sweep_points, write_png
            try:
                batches = [int(b) for b in args.sweep_batches.split(",") if b.strip()]
            except ValueError:
                return _fail(f"--sweep-batches {args.sweep_batches!r}: expected comma-separated integers")
            if not batches or min(batches) < 1:
                return _fail("--sweep-batches: need at least one batch size >= 1")
            ev = Evaluator(model=args.model, dtype=args.dtype, hardware=args.hardware, dense_dtype=args.dense_dtype,
                           contention_opt=args.contention_opt)
            pts = sweep_points(ev, d=result.dwdp_size, k=result.experts_per_worker, s=result.prefetch_stride,
                               batches=batches, cv=args.cv)
            write_png(args.sweep, pts, title=(f"{result.model} {result.dtype} on {result.hardware}, "
                                              f"DWDP{result.dwdp_size} (k={result.experts_per_worker}, "
                                              f"s={result.prefetch_stride}) vs DEP{result.dwdp_size}, cv={args.cv:g}"))
            print(f"dwdp plan: wrote {args.sweep}", file=sys.stderr)
    except (ModelConfigError, presets.PresetError, ValueError, KeyError, OSError) as e:
        msg = str(e).strip("'\"") or type(e).__name__
        return _fail(msg.splitlines()[0] if msg else type(e).__name__)
    if args.json:
        print(result.to_json())
    else:
        from .report import print_table
        print_table(result)
    return 0
