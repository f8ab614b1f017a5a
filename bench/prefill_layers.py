"""Where one prefill forward spends its time, and what the fused non-expert layers save (reports, never asserts).

The unsharded model of ``bench/prefill.py`` (same synthetic checkpoint, same ``--work-dir`` cache) on one GPU,
on DWDP's experts kernels, in four variants measured side by side in one run:
  * ``grouped_mm``        — plain `transformers` experts (reference point);
  * ``experts``           — DWDP's experts kernels only (the engine before the fused layers);
  * ``experts+norms``     — plus the one-pass RMSNorm (``layers_impl.install(rope=False)``);
  * ``experts+norms+rope``— plus the one-launch RoPE (what the engine runs on CUDA now).
For each: median forward ms over ``--iters`` (after 2 warm-ups), MFU (``prefill.prefill_flops`` ÷ time ÷
``--peak-tflops``), max |Δlogit| vs the ``experts`` variant, and whether the RoPE swap is bitwise
(``experts+norms`` vs ``experts+norms+rope`` logits must be equal). ``--profile`` adds a torch.profiler table
of one forward of the ``experts`` and the fully fused variant: kernels by CUDA time, top ``--rows``.

Run on a GPU:  python bench/prefill_layers.py --isl 16384 --num-experts 128 --num-heads 16 --profile
"""

from __future__ import annotations

import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

VARIANTS = ("grouped_mm", "experts", "experts+norms", "experts+norms+rope")


def parse_args(argv=None):
    from bench import prefill

    p = prefill.build_parser(__doc__)
    p.add_argument("--profile", action="store_true", help="print a torch.profiler kernel table per variant")
    p.add_argument("--rows", type=int, default=30, help="rows of each profiler table")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--trace-dir", help="also write Chrome traces of the profiled forwards here")
    return p.parse_args(argv)


def _set_variant(model, variant: str):
    """The model as ``variant`` runs it: an ``Attachment`` to close before the next variant."""
    from dwdp_worker.model import experts_impl, layers_impl
    from dwdp_worker.model.attach import attach

    if variant == "grouped_mm":
        return attach(model, device="cuda", experts="grouped_mm", fused_layers=False)
    # experts + every fused layer, or only some of them
    att = attach(model, device="cuda", experts=experts_impl.IMPL_NAME, fused_layers=variant == VARIANTS[-1])
    if variant == "experts+norms":
        layers_impl.install(model, rope=False)  # undone by _unset_variant
    return att


def _unset_variant(model, att) -> None:
    from dwdp_worker.model import layers_impl

    att.close()
    layers_impl.uninstall(model)  # the norms-only variant's (idempotent for the others)


def _time(model, seqs, device, iters: int):
    import torch

    from dwdp_worker.model.packing import packed_logits

    for _ in range(2):
        logits = packed_logits(model, seqs, device)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        logits = packed_logits(model, seqs, device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), logits


def _profile(model, seqs, device, rows: int, trace: str | None) -> str:
    from bench.profiling import profile_table
    from dwdp_worker.model.packing import packed_logits

    return profile_table(lambda: packed_logits(model, seqs, device), device, rows=rows, trace=trace).table


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/prefill_layers.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench.prefill import ensure_model, prefill_flops
    from dwdp_worker.checkpoint.loader import load_config
    from dwdp_worker.launch.oracle import Reference

    model_dir = ensure_model(args)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ref = Reference(model_dir, device=device)  # each variant attaches its own kernels
    gen = torch.Generator().manual_seed(1)
    vocab = int(ref.model.config.vocab_size)
    seqs = [torch.randint(0, vocab, (args.isl,), generator=gen).tolist() for _ in range(args.batch)]
    flops = prefill_flops(load_config(model_dir), [args.isl] * args.batch)["total"]
    peak = args.peak_tflops * 1e12
    rows, logits, tables = [], {}, {}
    for variant in VARIANTS:
        att = _set_variant(ref.model, variant)
        s, logits[variant] = _time(ref.model, seqs, device, args.iters)
        rows.append({"variant": variant, "ms": s * 1e3, "mfu": flops / s / peak})
        print(f"{variant}: {s * 1e3:.2f} ms, MFU {flops / s / peak:.1%}", flush=True)
        if args.profile and variant in ("experts", VARIANTS[-1]):
            trace = str(pathlib.Path(args.trace_dir) / f"trace-{variant}.json") if args.trace_dir else None
            tables[variant] = _profile(ref.model, seqs, device, args.rows, trace)
            print(f"\n## profile: {variant}\n{tables[variant]}", flush=True)
        _unset_variant(ref.model, att)
    base = logits["experts"]
    for r in rows:
        r["max_abs_dlogit_vs_experts"] = float((logits[r["variant"]] - base).abs().max())
    rope_bitwise = bool(torch.equal(logits["experts+norms"], logits["experts+norms+rope"]))
    print()
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}; model {model_dir.name}; "
          f"ISL {args.isl} x {args.batch}; model FLOPs/forward {flops / 1e12:.2f} T; peak {args.peak_tflops:.0f}")
    hdr = f"{'variant':>20} {'ms':>8} {'MFU':>6} {'max|dlogit| vs experts':>23}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['variant']:>20} {r['ms']:>8.2f} {r['mfu']:>6.1%} {r['max_abs_dlogit_vs_experts']:>23.3g}")
    print(f"RoPE swap bitwise (experts+norms == experts+norms+rope logits): {rope_bitwise}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": rows, "rope_bitwise": rope_bitwise,
                                                       "profiles": tables}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
