"""sm_gather on one GPU: copy GB/s alone and the "compute tax" on a concurrent GEMM, per CTA count.

    python bench/sm_gather.py [--mib 1024 --piece-mib 2 --ctas 8,16,32,64,132,264] [--out out/smg]

A DWDP-like copy plan (``--mib`` of 2 MiB pieces, scattered and shuffled, HBM→HBM on one GPU) is
copied by ``copy_engine`` (one ``cuMemcpyAsync`` per piece through ``CudaStreams``; on ONE GPU the
driver runs these as SM kernels) and by the sm_gather kernel with each CTA count. For each it
measures: copy GB/s alone; a bf16 GEMM loop (compute stream, default priority) alone and with the
copies running concurrently on the copy stream (lowest priority) — tax = GEMM time with copy ÷ alone
− 1, and how much the copy was slowed; the same with the GEMM on a higher-priority stream; host µs
per enqueue. The GEMM window is sized to ~the copy_engine copy time; a tax is only meaningful where
the copy spans the whole window (last column; else the tax is diluted). With small pieces
copy_engine is host-bound (one driver call per piece), so use ``--piece-mib 64`` to compare device
work. Every mode is checked bitwise once. Prints a markdown table (also ``sm_gather.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--piece-mib", type=int, default=2)
    ap.add_argument("--ctas", default="8,16,32,64,132,264")
    ap.add_argument("--reps", type=int, default=12, help="plan copies per timed window")
    ap.add_argument("--gemm", type=int, default=8192, help="square bf16 GEMM size")
    ap.add_argument("--out", default="out/smg")
    args = ap.parse_args(argv)
    import torch

    from dwdp_runtime.cuda_streams import CudaStreams
    from dwdp_runtime.sm_gather import SmGather

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    n, piece = args.mib << 20, args.piece_mib << 20
    src = torch.randint(0, 255, (n + (64 << 20),), dtype=torch.uint8, device=dev)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(n // piece, generator=g).tolist()
    pieces = [(dst.data_ptr() + i * piece, src.data_ptr() + (64 << 20) + j * piece, piece)
              for i, j in enumerate(order)]
    ref = torch.empty_like(dst)
    for i, j in enumerate(order):
        ref[i * piece:(i + 1) * piece] = src[(64 << 20) + j * piece:(64 << 20) + (j + 1) * piece]

    ce = CudaStreams(device=dev, transfer="copy_engine")
    copy_stream = ce.copy_stream  # priority 0 = lowest, as in DWDP
    ce_plan = ce.compile(pieces)
    t0 = time.perf_counter()
    gathers = {c: SmGather(device=dev, ctas=c) for c in (int(x) for x in args.ctas.split(","))}
    setup_s = time.perf_counter() - t0
    modes = {"copy_engine": lambda: ce.enqueue_copies(ce_plan)}
    for c, gth in gathers.items():
        plan = gth.compile(pieces)
        modes[f"sm_gather ctas={c}"] = (lambda gth=gth, plan=plan: gth.launch(plan, copy_stream))

    a = torch.randn(args.gemm, args.gemm, device=dev, dtype=torch.bfloat16)
    b = torch.randn(args.gemm, args.gemm, device=dev, dtype=torch.bfloat16)
    c_out = torch.empty_like(a)
    hp = torch.cuda.Stream(device=dev, priority=-1)

    def gemms(k):
        for _ in range(k):
            torch.mm(a, b, out=c_out)

    def timed(stream, fn):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(stream)
        fn()
        e1.record(stream)
        return e0, e1

    def copy_alone(fn):
        torch.cuda.synchronize()
        e0, e1 = timed(copy_stream, lambda: [fn() for _ in range(args.reps)])
        torch.cuda.synchronize()
        return e0.elapsed_time(e1)

    def gemm_alone(k, stream):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            e0, e1 = timed(stream, lambda: gemms(k))
        torch.cuda.synchronize()
        return e0.elapsed_time(e1)

    def together(fn, k, stream):
        torch.cuda.synchronize()
        start = torch.cuda.Event()
        start.record(stream)
        copy_stream.wait_event(start)
        c0, c1 = timed(copy_stream, lambda: [fn() for _ in range(args.reps)])
        with torch.cuda.stream(stream):
            g0, g1 = timed(stream, lambda: gemms(k))
        torch.cuda.synchronize()
        return g0.elapsed_time(g1), c0.elapsed_time(c1)

    # warm-up, bitwise check of every mode
    gemms(2)
    rows = []
    for name, fn in modes.items():
        dst.zero_()
        torch.cuda.synchronize()
        copy_stream.wait_stream(torch.cuda.current_stream())
        fn()
        torch.cuda.synchronize()
        assert torch.equal(dst, ref), f"{name}: copy is not bitwise equal"
    gemm1 = gemm_alone(3, torch.cuda.current_stream()) / 3
    t_ce = copy_alone(modes["copy_engine"])
    k = max(1, int(0.8 * t_ce / gemm1))  # GEMM window ≈ 80 % of the copy_engine copy window
    g_alone = gemm_alone(k, torch.cuda.current_stream())
    g_alone_hp = gemm_alone(k, hp)
    for name, fn in modes.items():
        t_copy = copy_alone(fn)
        g_with, c_with = together(fn, k, torch.cuda.current_stream())
        g_with_hp, c_with_hp = together(fn, k, hp)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host_us = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        rows.append((name, args.reps * n / (t_copy * 1e-3) / 1e9, g_with / g_alone - 1, c_with / t_copy,
                     g_with_hp / g_alone_hp - 1, c_with_hp / t_copy, host_us,
                     "yes" if min(c_with, c_with_hp) >= 0.95 * g_alone else "no"))
    gpu = torch.cuda.get_device_name(dev)
    lines = [f"sm_gather sweep — {gpu}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; plan: {args.mib} MiB in "
             f"{n // piece} × {args.piece_mib} MiB pieces (shuffled, HBM→HBM, one GPU), ×{args.reps} per window; "
             f"GEMM {args.gemm}³ bf16 × {k} ({g_alone:.2f} ms alone, {2 * args.gemm**3 * k / g_alone / 1e9:.0f} "
             f"TFLOP/s); SmGather setup (import + JIT + load, {len(gathers)} instances) {setup_s:.2f} s",
             "",
             "| mode | copy GB/s alone | GEMM tax (same prio) | copy slowed × | GEMM tax (GEMM hi-prio) | copy slowed × "
             "| host µs / enqueue | copy spans the GEMM window |",
             "|---|---|---|---|---|---|---|---|"]
    for name, gbps, tax, cs, tax_hp, cs_hp, host, spans in rows:
        lines.append(f"| {name} | {gbps:.0f} | {100 * tax:+.0f} % | {cs:.2f} | {100 * tax_hp:+.0f} % | {cs_hp:.2f} "
                     f"| {host:.1f} | {spans} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sm_gather.md"), "w") as f:
        f.write(text + "\n")
    ce.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
