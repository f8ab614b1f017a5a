"""What ``--batch-invariant`` costs (reports, never asserts): the dense GEMMs and one whole prefill, cuBLAS vs ours.

  1. **GEMMs**: each dense projection of a Qwen3-30B-A3B and a DeepSeek-V3 layer (``SHAPES``: ``[T, K] @ [K, N]``,
     bf16) at T = 1K, 4K, 16K tokens: cuBLAS (``F.linear``) ms, ``bi_matmul`` ms, their ratio, TFLOP/s, and
     whether a row alone equals the same row packed (bitwise) for each;
  2. **prefill**: the unsharded synthetic model of ``bench/prefill.py`` (Qwen3-MoE, ``--prefill-layers`` 4,
     hidden 2048, 16 heads, ``--prefill-experts`` 64 × 768, top-8, our experts and fused layers) at ``--isl``: forward ms with the mode off and on (the GEMMs and the
     per-sequence attention, as ``attach`` installs it), the slowdown (issue #34's goal ≤ 10 %), the forward of
     the sequence packed with a quarter-length one (off, on, and the per-sequence attention alone), and the logits
     of the sequence alone vs packed, both ways (bitwise or max |Δ|).

Run on a GPU:   python bench/batch_invariant.py [--isl 4096 16384] [--only gemm|prefill]
CPU smoke test: TRITON_INTERPRET=1 python bench/batch_invariant.py --device cpu --tokens 64 --only gemm --scale 16
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@dataclass(frozen=True)
class Gemm:
    name: str
    k: int   # in features
    n: int   # out features


#: the dense GEMMs of one layer (Qwen3-30B-A3B: hidden 2048, 32 q / 4 kv heads × 128, 128 experts; DeepSeek-V3:
#: hidden 7168, MLA q_lora 1536, kv_lora 512 (+ 64 rope), 128 heads × (128 nope + 64 rope) / v 128, 256 experts,
#: one shared expert of 2048)
SHAPES: dict[str, tuple[Gemm, ...]] = {
    "qwen3": (Gemm("qkv_proj", 2048, 5120), Gemm("o_proj", 4096, 2048), Gemm("router", 2048, 128)),
    "deepseek_v3": (Gemm("q_a_proj", 7168, 1536), Gemm("q_b_proj", 1536, 24576), Gemm("kv_a_proj", 7168, 576),
                    Gemm("kv_b_proj", 512, 32768), Gemm("o_proj", 16384, 7168), Gemm("shared_gate_up", 7168, 4096),
                    Gemm("shared_down", 2048, 7168), Gemm("router", 7168, 256)),
}
TOKENS = (1024, 4096, 16384)


def _time_ms(fn, device, iters: int) -> float:
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(iters):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_gemms(device, tokens, iters: int, scale: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from dwdp_runtime.kernels import bi_matmul

    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for model, gemms in SHAPES.items():
        for g in gemms:
            k, n = max(1, g.k // scale), max(1, g.n // scale)
            w = (torch.randn(n, k, generator=gen, device=device) * k ** -0.5).bfloat16()
            for t in tokens:
                x = torch.randn(t, k, generator=gen, device=device).bfloat16()
                cublas = _time_ms(lambda: F.linear(x, w), device, iters)
                ours = _time_ms(lambda: bi_matmul.matmul(x, w.t()), device, iters)
                full = bi_matmul.matmul(x, w.t())
                pick = t // 3
                alone = bi_matmul.matmul(x[pick:pick + 1], w.t())
                ref_alone, ref_full = F.linear(x[pick:pick + 1], w), F.linear(x, w)[pick:pick + 1]
                flops = 2 * t * k * n
                rows.append(dict(model=model, gemm=g.name, tokens=t, k=k, n=n, cublas_ms=round(cublas, 4),
                                 ours_ms=round(ours, 4), ratio=round(ours / cublas, 3),
                                 ours_tflops=round(flops / ours / 1e9, 1), cublas_tflops=round(flops / cublas / 1e9, 1),
                                 ours_row_bitwise=bool(torch.equal(alone, full[pick:pick + 1])),
                                 cublas_row_bitwise=bool(torch.equal(ref_alone, ref_full)),
                                 max_abs_vs_cublas=round((full.float() - F.linear(x, w).float()).abs().max().item(), 5)))
                print(f"  {model:12s} {g.name:15s} T={t:6d} [{k}->{n}]  cuBLAS {cublas:8.3f} ms  ours {ours:8.3f} ms  "
                      f"×{ours / cublas:5.2f}  row alone=packed: ours {rows[-1]['ours_row_bitwise']}, "
                      f"cuBLAS {rows[-1]['cublas_row_bitwise']}", flush=True)
    return rows


def bench_prefill(device, isls, iters: int, layers: int, experts: int) -> list[dict]:
    import torch

    from bench.prefill import ensure_model, parse_args, prefill_flops
    from dwdp_runtime.kernels import batch_invariant
    from dwdp_worker.checkpoint.loader import load_config
    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model import attention

    rows = []
    args = parse_args(["--isl", str(max(isls)), "--num-layers", str(layers), "--num-experts", str(experts)])
    model_dir = ensure_model(args)  # one checkpoint for every ISL (bench/host_gap.py's with the same flags)
    ref = Reference(model_dir, device=device, experts="dwdp" if device.type == "cuda" else "auto")
    for isl in isls:
        gen = torch.Generator().manual_seed(isl)
        seq = torch.randint(0, args.vocab_size, (isl,), generator=gen).tolist()
        other = torch.randint(0, args.vocab_size, (max(1, isl // 4),), generator=gen).tolist()
        flops = prefill_flops(load_config(model_dir), [isl])["total"]
        result = {"isl": isl}
        for mode in ("off", "attention", "on"):
            # "on": the mode as attach(batch_invariant=True) installs it (the GEMMs and the per-sequence attention);
            # "attention": the per-sequence attention alone (what it costs or saves beside SDPA's masked kernel)
            handles = ([batch_invariant.enable(device.type)] if mode == "on" else []) + (
                [attention.install_per_sequence(ref.model)] if mode != "off" else [])
            try:
                ms = _time_ms(lambda: ref.logits([seq]), device, iters)
                packed_ms = _time_ms(lambda: ref.logits([other, seq]), device, iters)
                alone, packed = ref.logits([seq]), ref.logits([other, seq])
                same = bool(torch.equal(alone[0], packed[1]))
                result[mode] = dict(ms=round(ms, 3), packed_ms=round(packed_ms, 3),
                                    mfu=round(flops / (ms / 1e3) / 790e12, 4), alone_eq_packed=same,
                                    max_abs=round((alone[0] - packed[1]).abs().max().item(), 5))
            finally:
                for handle in reversed(handles):
                    handle.close()
        result["slowdown"] = round(result["on"]["ms"] / result["off"]["ms"] - 1.0, 4)
        result["packed_slowdown"] = round(result["on"]["packed_ms"] / result["off"]["packed_ms"] - 1.0, 4)
        print(f"  prefill ISL {isl}: off {result['off']['ms']:.2f} ms (MFU {result['off']['mfu']:.1%}, alone=packed "
              f"{result['off']['alone_eq_packed']}, max|Δ| {result['off']['max_abs']}), on {result['on']['ms']:.2f} ms "
              f"(alone=packed {result['on']['alone_eq_packed']}, max|Δ| {result['on']['max_abs']}): slowdown "
              f"{result['slowdown']:+.1%} (goal <= +10%); packed with a {len(other)}-token sequence: off "
              f"{result['off']['packed_ms']:.2f} ms, on {result['on']['packed_ms']:.2f} ms "
              f"({result['packed_slowdown']:+.1%}), per-sequence attention alone {result['attention']['packed_ms']:.2f} "
              f"ms (alone=packed {result['attention']['alone_eq_packed']})", flush=True)
        rows.append(result)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--only", choices=("gemm", "prefill"), default=None)
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--isl", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--scale", type=int, default=1, help="divide every K and N by this (CPU smoke runs)")
    p.add_argument("--prefill-layers", type=int, default=4)
    p.add_argument("--prefill-experts", type=int, default=64)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    import torch

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    out: dict = {}
    if args.only in (None, "gemm"):
        print("dense GEMMs, cuBLAS vs batch-invariant (bf16):", flush=True)
        out["gemm"] = bench_gemms(device, args.tokens, args.iters, args.scale)
    if args.only in (None, "prefill"):
        print("prefill, mode off vs on (unsharded, our experts):", flush=True)
        out["prefill"] = bench_prefill(device, args.isl, args.iters, args.prefill_layers, args.prefill_experts)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
