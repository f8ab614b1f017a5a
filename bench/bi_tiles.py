"""Which fixed tiling ``bi_matmul`` should use: candidate tilings vs cuBLAS on the dense GEMMs that matter (reports).

The batch-invariant GEMM may pick its tiling from ``(N, K, dtype)`` only (``bi_matmul.config_for``), never from M.
This sweep times each candidate (``CANDIDATES``: block M/N/K, warps, stages, persistent or one tile per program)
on the bf16 shapes of ``bench/batch_invariant.SHAPES`` at T tokens, beside cuBLAS (``F.linear``) in the same run,
and prints per shape the ratio cuBLAS ÷ candidate (1.0 = as fast) and the best candidate, plus whether the best
one keeps a row's bits alone vs packed (it must: the tiling is M-free).

    python bench/bi_tiles.py [--tokens 4096 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.batch_invariant import SHAPES  # noqa: E402


def _time_ms(fn, device, iters: int) -> float:
    """Mean ms per call over ``iters`` calls queued back to back between two events (after one warm-up call):
    the GPU time of the kernel, not the host's launch latency (the server replays CUDA graphs)."""
    import torch

    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters

#: name -> (block_m, block_n, block_k, warps, stages, kernel): "persistent", "tiled" (``_tiled_mm``, pointer loads)
#: or "tma" (``_tma_mm``, operands through TMA descriptors) — bi_matmul.Kernel
CANDIDATES = {
    "persistent 128x128x64/8w/3s (routers)": (128, 128, 64, 8, 3, "persistent"),
    "tiled 128x256x64/8w/4s (2026-12-04)": (128, 256, 64, 8, 4, "tiled"),
    "tma 128x256x64/8w/4s": (128, 256, 64, 8, 4, "tma"),
    "tma 128x256x64/8w/3s": (128, 256, 64, 8, 3, "tma"),
    "tma 128x128x64/8w/4s": (128, 128, 64, 8, 4, "tma"),
    "tma 128x128x64/4w/5s": (128, 128, 64, 4, 5, "tma"),
    "tma 256x128x64/8w/3s": (256, 128, 64, 8, 3, "tma"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from dwdp_runtime.kernels import bi_matmul

    dev = torch.device("cuda")
    programs = bi_matmul.num_programs(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, wins = [], {}
    for t in args.tokens:
        for model, gemms in SHAPES.items():
            for g in gemms:
                x = torch.randn(t, g.k, generator=gen, device=dev).to(torch.bfloat16)
                w = (torch.randn(g.n, g.k, generator=gen, device=dev) * g.k ** -0.5).to(torch.bfloat16)
                cublas = _time_ms(lambda: F.linear(x, w), dev, args.iters)
                line = {"tokens": t, "model": model, "gemm": g.name, "k": g.k, "n": g.n, "cublas_ms": cublas,
                        "ratio": {}}
                for name, (bm, bn, bk, warps, stages, kernel) in CANDIDATES.items():
                    tile = bi_matmul.Tile(bm, bn, bk, warps, stages)
                    out = torch.empty(1, t, g.n, dtype=x.dtype, device=dev)
                    run = lambda: bi_matmul.launch(x.unsqueeze(0), w.t().unsqueeze(0), out, None, tile,  # noqa: E731
                                                   programs, kernel)
                    try:
                        ms = _time_ms(run, dev, args.iters)
                    except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is reported
                        line["ratio"][name] = f"failed: {type(exc).__name__}"
                        continue
                    line["ratio"][name] = round(cublas / ms, 3)
                best = max((v, k) for k, v in line["ratio"].items() if isinstance(v, float))
                line["best"] = best[1]
                wins.setdefault(best[1], 0)
                wins[best[1]] += 1
                bm, bn, bk, warps, stages, kernel = CANDIDATES[best[1]]
                tile = bi_matmul.Tile(bm, bn, bk, warps, stages)
                full = torch.empty(1, t, g.n, dtype=x.dtype, device=dev)
                bi_matmul.launch(x.unsqueeze(0), w.t().unsqueeze(0), full, None, tile, programs, kernel)
                part = torch.empty(1, 37, g.n, dtype=x.dtype, device=dev)
                bi_matmul.launch(x[130:167].unsqueeze(0), w.t().unsqueeze(0), part, None, tile, programs, kernel)
                one = torch.empty(1, 1, g.n, dtype=x.dtype, device=dev)
                bi_matmul.launch(x[9:10].unsqueeze(0), w.t().unsqueeze(0), one, None, tile, programs, kernel)
                line["best_rows_bitwise"] = bool(torch.equal(part[0], full[0, 130:167])
                                                 and torch.equal(one[0], full[0, 9:10]))
                rows.append(line)
                print(f"T={t:>6} {model:>12} {g.name:>15} [{g.k}x{g.n}] cuBLAS {cublas:7.3f} ms | "
                      + " | ".join(f"{k}: {v}" for k, v in line["ratio"].items())
                      + f" | best {best[1]} ({best[0]}) rows bitwise {line['best_rows_bitwise']}", flush=True)
    print("wins:", wins)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "wins": wins}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
