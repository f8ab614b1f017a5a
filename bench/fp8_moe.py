"""FP8 block-scaled experts on one GPU: grouped GEMM TFLOP/s vs bf16, the MoE block, accuracy — side by side.

For each shape (DeepSeek-V3 experts: H 7168, I 2048, top-8, 64 of its 256 experts so bf16 fits next to fp8;
Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8) and token count T, with uniformly random routing:

  * ``bf16 grouped_mm``  — the floor the fused-kernel issue uses: ``torch._grouped_mm`` on expert-sorted rows,
                           gate_up then down (no activation, no gather/scatter);
  * ``fp8 GEMMs``        — our two block-scaled Triton GEMMs alone (``fp8_gate_up`` incl. its act·mul and e4m3
                           epilogue, ``fp8_down`` incl. the routing weight), routing plan and input quantization
                           outside the timing;
  * ``cute GEMMs``        — the CuTe DSL warp-specialised block-scaled GEMMs (``fp8_cute``, sm_90) on the same
                           operands in plan-row order (gather and reduce outside the timing): GEMM 1 fused with
                           act·mul and its e4m3 epilogue (as the Triton GEMM 1 is; the bf16-out GEMM 1 beside
                           it), GEMM 2; one row per ``--cute-configs`` entry (each checked to give the first
                           entry's bits) and one for the shipped defaults (``FUSED_CONFIG`` / ``PLAIN_CONFIG``),
                           which the block runs; skipped with the reason where CuTe DSL is missing;
  * ``bf16 block`` / ``fp8 block`` / ``cute block`` — whole routed-experts forwards: ``kernels.fused_experts`` on
                           the dequantized bf16 weights vs ``triton_fp8_moe_forward`` (quantize + align + 2 GEMMs +
                           reduce) vs ``cute_fp8_moe_forward`` (quantize + align + gather + fused GEMM 1 + GEMM 2
                           + reduce);
  * accuracy of the fp8 block against the bf16 block on the dequantized weights (max |Δ| / max |ref|, and the
    fraction of tokens whose arg-max hidden unit agrees — a cheap proxy; the model-level top-1 agreement is
    measured by ``bench/prefill.py --quant fp8``).

FLOPs of both GEMMs: ``6·T·k·H·I``. Times: CUDA events, median of ``do_bench``. Tiles of the fp8 GEMMs are
tuned once per shape at warm-up (``fp8_moe.tune_fp8``), outside the timed calls.

    python bench/fp8_moe.py --tokens 4096 16384 --json out.json
    python bench/fp8_moe.py --no-tune --rounds 3        (each ratio's median and range over 3 rounds)
    python bench/fp8_moe.py --no-triton --rounds 3      (the CuTe path and the bf16 references only)
    python bench/fp8_moe.py --no-triton --trace         (+ where the CuTe GEMMs' cycles go, per role)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

SHAPES = {  # name: (hidden, moe_intermediate, experts, top_k)
    "deepseek_v3": (7168, 2048, 64, 8),
    "qwen3_30b": (2048, 768, 128, 8),
    "tiny": (256, 128, 8, 2),  # --smoke: the script's own test on CPU under TRITON_INTERPRET=1
}


def _experts(h, i, e, dev, seed):
    """Seeded random experts, quantized on ``dev`` (fp8 + scales) and their dequantized bf16 twins."""
    import torch

    from dwdp_runtime.quant import fp8_block

    gen = torch.Generator(device=dev).manual_seed(seed)
    w1, s1 = fp8_block.quantize(torch.randn(e, 2 * i, h, generator=gen, device=dev) * h ** -0.5, row_segments=(i, i))
    w2, s2 = fp8_block.quantize(torch.randn(e, h, i, generator=gen, device=dev) * i ** -0.5)
    d1 = fp8_block.dequantize(w1, s1, torch.bfloat16, row_segments=(i, i))
    d2 = fp8_block.dequantize(w2, s2, torch.bfloat16)
    return w1, s1, w2, s2, d1, d2


def parse_cute_config(text: str):
    """``N[:m|n][:S][:C]`` → ``CuteGemmConfig(tile_n=N, raster_along_m=…, swizzle=S, cluster_n=C)``
    (e.g. ``128:n:1:2``)."""
    from dwdp_runtime.kernels.fp8_cute import CuteGemmConfig

    parts = text.split(":")
    return CuteGemmConfig(tile_n=int(parts[0]), raster_along_m=len(parts) > 1 and parts[1] == "m",
                          swizzle=int(parts[2]) if len(parts) > 2 else 1,
                          cluster_n=int(parts[3]) if len(parts) > 3 else 2)


def cute_trace(name, t, gemms) -> dict:
    """``--trace``: each default GEMM once more in the trace build (``fp8_cute_trace.trace_buffer`` /
    ``phase_shares``): the share of every role's SM cycles spent waiting for a stage, for its own wgmma and in the
    epilogue."""
    import torch

    from dwdp_runtime.kernels import fp8_cute_trace

    out = {}
    for label, launch in gemms:
        counters = fp8_cute_trace.trace_buffer(torch.device("cuda"))
        launch(counters)  # the first traced launch compiles the trace build
        counters.zero_()
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        launch(counters)
        ended.record()
        torch.cuda.synchronize()
        shares = fp8_cute_trace.phase_shares(counters)
        wall_ms = began.elapsed_time(ended)
        mhz = fp8_cute_trace.sm_clock_hz(counters, wall_ms / 1e3) / 1e6
        out[label] = dict(roles=shares, sm_clock_mhz=mhz)
        print(f"[{name}] T={t}: trace {label}: {wall_ms:.3f} ms at ~{mhz:.0f} MHz", flush=True)
        for role, s in shares.items():
            print(f"[{name}] T={t}: trace {label}, {role}: waiting for a stage {s['stage_wait']:.1%}, for its wgmma "
                  f"{s['mma_wait']:.1%}, epilogue {s['epilogue']:.1%} of its cycles; {s['tiles_per_cta']:.1f} tiles/CTA",
                  flush=True)
    return out


def cute_rows(name, t, x, ids, w, w1, s1, w2, s2, *, bench, cute_configs, flops, t_bf16, t_bblock, ref,
              trace: bool = False):
    """The CuTe path at one shape: GEMMs per config (plan-row operands prepared outside the timing), the block."""
    import torch

    from dwdp_runtime.kernels import fp8_cute
    from dwdp_runtime.kernels.fp8_plan_rows import act_quant_plan_rows, gather_plan_rows
    from dwdp_runtime.kernels.fp8_quant import quantize_groups
    from dwdp_runtime.kernels.routing import align_routing

    why = fp8_cute.unavailable()
    if why:
        print(f"[{name}] T={t}: CuTe path skipped: {why}", flush=True)
        return dict(cute_skipped=why)
    i = w2.shape[2]
    plan = align_routing(ids, w1.shape[0], fp8_cute.TILE_M)
    xq, xsc = quantize_groups(x)
    a, sa = gather_plan_rows(xq, xsc, plan)
    out = {}
    first = None  # the first config's outputs: tiles and rasters move no arithmetic, so every config gives its bits
    for text in cute_configs:
        cfg = parse_cute_config(text)
        gu = fp8_cute.block_scaled_grouped_gemm(a, sa, w1, s1, plan.block_expert, torch.bfloat16, cfg)
        h, hs = act_quant_plan_rows(gu, plan, i)
        y = fp8_cute.block_scaled_grouped_gemm(h, hs, w2, s2, plan.block_expert, torch.bfloat16, cfg)
        hf, _ = fp8_cute.gate_up_act_quant(a, sa, w1, s1, plan.block_expert, i, cfg)
        live = int(plan.num_padded)
        outputs = (gu[:live], y[:live], hf[:live].view(torch.uint8))
        first = first or outputs
        same_bits = all(torch.equal(p, q) for p, q in zip(outputs, first))
        # GEMM 1 as the Triton one is timed: with its act·mul and e4m3 epilogue (the fused gate_up)
        t1 = bench(lambda: fp8_cute.gate_up_act_quant(a, sa, w1, s1, plan.block_expert, i, cfg))
        t1_plain = bench(lambda: fp8_cute.block_scaled_grouped_gemm(a, sa, w1, s1, plan.block_expert, torch.bfloat16,
                                                                    cfg))
        t2 = bench(lambda: fp8_cute.block_scaled_grouped_gemm(h, hs, w2, s2, plan.block_expert, torch.bfloat16, cfg))
        out[text] = dict(gate_up_ms=t1, gate_up_plain_ms=t1_plain, down_ms=t2, tflops=flops / (t1 + t2) / 1e9,
                         over_bf16=t_bf16 / (t1 + t2), plain_over_bf16=t_bf16 / (t1_plain + t2),
                         same_bits_as_first=same_bits)
        print(f"[{name}] T={t}: cute {text}: GEMMs {t1 + t2:.3f} ms ({out[text]['tflops']:.0f} TFLOP/s) = "
              f"{out[text]['over_bf16']:.2f}x bf16, plain GEMMs {out[text]['plain_over_bf16']:.2f}x (fused gate_up "
              f"{t1:.3f} [bf16-out gate_up {t1_plain:.3f}], down {t2:.3f}); bits as the first config: {same_bits}",
              flush=True)
    # the shipped defaults, which the block runs: the fused gate_up at FUSED_CONFIG, the plain GEMMs at PLAIN_CONFIG
    t1 = bench(lambda: fp8_cute.gate_up_act_quant(a, sa, w1, s1, plan.block_expert, i))
    t1_plain = bench(lambda: fp8_cute.block_scaled_grouped_gemm(a, sa, w1, s1, plan.block_expert))
    t2 = bench(lambda: fp8_cute.block_scaled_grouped_gemm(h, hs, w2, s2, plan.block_expert))
    got = fp8_cute.cute_fp8_moe_forward(x, ids, w, w1, s1, w2, s2)
    t_block = bench(lambda: fp8_cute.cute_fp8_moe_forward(x, ids, w, w1, s1, w2, s2))
    err = (got.float() - ref.float()).abs()
    r = dict(cute_configs=out, cute_gate_up_ms=t1, cute_gate_up_plain_ms=t1_plain, cute_down_ms=t2,
             cute_gemms_ms=t1 + t2, cute_tflops=flops / (t1 + t2) / 1e9, cute_over_bf16_tflops=t_bf16 / (t1 + t2),
             cute_plain_over_bf16_tflops=t_bf16 / (t1_plain + t2), cute_block_ms=t_block,
             cute_block_over_bf16_block=t_block / t_bblock, cute_rel_max_err=float(err.max() / ref.float().abs().max()))
    print(f"[{name}] T={t}: cute defaults: GEMMs {t1 + t2:.3f} ms = {r['cute_over_bf16_tflops']:.2f}x bf16 (fused gate_up "
          f"{t1:.3f}, down {t2:.3f}), plain GEMMs {t1_plain + t2:.3f} ms = {r['cute_plain_over_bf16_tflops']:.2f}x; block "
          f"{t_block:.3f} ms = {r['cute_block_over_bf16_block']:.3f} of bf16 block | rel err {r['cute_rel_max_err']:.4f}",
          flush=True)
    if trace:
        r["cute_trace"] = cute_trace(name, t, (
            ("fused gate_up", lambda tr: fp8_cute.gate_up_act_quant(a, sa, w1, s1, plan.block_expert, i, trace=tr)),
            ("down", lambda tr: fp8_cute.block_scaled_grouped_gemm(h, hs, w2, s2, plan.block_expert, trace=tr))))
    return r


def triton_rows(t, x, ids, w, w1, s1, w2, s2, *, bench, flops, t_bf16, t_bblock, ref) -> dict:
    """The Triton FP8 path at one shape: its two GEMMs alone (plan and input quantization outside the timing) and
    its whole block, with the block's accuracy against the bf16 block."""

    from dwdp_runtime.kernels import fp8_moe
    from dwdp_runtime.kernels.fp8_grouped_gemm import fp8_down, fp8_gate_up
    from dwdp_runtime.kernels.fp8_quant import quantize_groups
    from dwdp_runtime.kernels.routing import align_routing

    k, e, h, i = ids.shape[1], w1.shape[0], w2.shape[1], w2.shape[2]
    c1, c2 = fp8_moe.configs_for(t, k, w1, w2)
    plan = align_routing(ids, e, c1.block_m)
    xq, xsc = quantize_groups(x)
    aq, a_s = fp8_gate_up(xq, xsc, w1, s1, plan, c1, inter=i, up_srow=-(-i // 128))
    t_g1 = bench(lambda: fp8_gate_up(xq, xsc, w1, s1, plan, c1, inter=i, up_srow=-(-i // 128)))
    t_g2 = bench(lambda: fp8_down(aq, a_s, w2, s2, w, plan, c2, hidden=h))
    got = fp8_moe.triton_fp8_moe_forward(x, ids, w, w1, s1, w2, s2)
    t_fblock = bench(lambda: fp8_moe.triton_fp8_moe_forward(x, ids, w, w1, s1, w2, s2))
    err = (got.float() - ref.float()).abs()
    agree = float((got.float().argmax(-1) == ref.float().argmax(-1)).float().mean())
    return dict(fp8_gemms_ms=t_g1 + t_g2, fp8_gate_up_ms=t_g1, fp8_down_ms=t_g2,
                fp8_tflops=flops / (t_g1 + t_g2) / 1e9, fp8_over_bf16_tflops=t_bf16 / (t_g1 + t_g2),
                fp8_block_ms=t_fblock, fp8_block_over_bf16_block=t_fblock / t_bblock,
                max_abs_err=float(err.max()), rel_max_err=float(err.max() / ref.float().abs().max()),
                mean_abs_err=float(err.mean()), argmax_agreement=agree, cfg_gate_up=str(c1), cfg_down=str(c2))


def run_shape(name, tokens, *, tune: bool, rep_ms: int, smoke: bool = False, tune_tokens=(16384,),
              cute_configs=(), with_triton: bool = True, trace: bool = False):
    import torch
    import triton.testing

    from dwdp_runtime.kernels import fp8_moe
    from dwdp_runtime.kernels.moe import ExpertWeights, fused_experts

    h, i, e, k = SHAPES[name]
    dev = torch.device("cpu" if smoke else "cuda")
    w1, s1, w2, s2, d1, d2 = _experts(h, i, e, dev, 0)
    if smoke:
        bench = lambda fn: (fn(), 1.0)[1]  # noqa: E731 - runs every path once, times nothing
    else:
        bench = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))  # noqa: E731
    if tune and with_triton:
        t0 = time.perf_counter()
        fp8_moe.tune_fp8(w1, s1, w2, s2, top_k=k, token_counts=list(tune_tokens), rep_ms=10)
        print(f"[{name}] tuned fp8 tiles for T={list(tune_tokens)} in {time.perf_counter() - t0:.1f} s", flush=True)
    rows = []
    for t in tokens:
        g = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
        w, ids = torch.topk(torch.rand(t, e, device=dev, generator=g), k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.float32)
        flops = 6 * t * k * h * i
        # bf16 floor: torch._grouped_mm over expert-sorted rows
        order = torch.sort(ids.flatten(), stable=True)
        xs = x[order.indices // k]
        offs = torch.cumsum(torch.bincount(order.values, minlength=e), 0).to(torch.int32)
        act = torch.randn(t * k, i, device=dev, dtype=torch.bfloat16, generator=g)
        t_bf16 = bench(lambda: (torch._grouped_mm(xs, d1.transpose(-2, -1), offs=offs),
                                torch._grouped_mm(act, d2.transpose(-2, -1), offs=offs)))
        # our bf16 block: the reference output and the denominator of every block ratio
        bw = ExpertWeights(gate_up=d1, down=d2)
        ref = fused_experts(x, ids, w, bw)
        t_bblock = bench(lambda: fused_experts(x, ids, w, bw))
        r = dict(shape=name, tokens=t, hidden=h, inter=i, experts=e, top_k=k, bf16_grouped_mm_ms=t_bf16,
                 bf16_tflops=flops / t_bf16 / 1e9, bf16_block_ms=t_bblock)
        common = dict(bench=bench, flops=flops, t_bf16=t_bf16, t_bblock=t_bblock, ref=ref)
        if with_triton:
            r.update(triton_rows(t, x, ids, w, w1, s1, w2, s2, **common))
        if cute_configs:
            try:
                r.update(cute_rows(name, t, x, ids, w, w1, s1, w2, s2, cute_configs=cute_configs, trace=trace,
                                   **common))
            except Exception as exc:  # noqa: BLE001 - the Triton numbers above still stand
                r["cute_error"] = f"{type(exc).__name__}: {exc}"
                print(f"[{name}] T={t}: CuTe path failed: {r['cute_error']}", flush=True)
        rows.append(r)
        line = f"[{name}] T={t}: bf16 grouped_mm {t_bf16:.3f} ms ({r['bf16_tflops']:.0f} TFLOP/s) | block bf16 {t_bblock:.3f} ms"
        if with_triton:
            line += (f" | Triton fp8 GEMMs {r['fp8_gemms_ms']:.3f} ms ({r['fp8_tflops']:.0f} TFLOP/s) = "
                     f"{r['fp8_over_bf16_tflops']:.2f}x | block fp8 {r['fp8_block_ms']:.3f} ms = "
                     f"{r['fp8_block_over_bf16_block']:.3f} | rel err {r['rel_max_err']:.4f} argmax agree "
                     f"{r['argmax_agreement']:.4f}")
        print(line, flush=True)
    return rows


def gpu_check(dev="cuda"):
    """The GPU's own fp8 conversion and MMA against the torch block math (small shape)."""
    import torch

    sys.path.insert(0, ".")
    from tests.kernels.fp8_reference import fp8_moe_reference

    from dwdp_runtime.kernels import fp8_moe
    from dwdp_runtime.kernels.fp8_quant import quantize_groups, quantize_groups_reference

    gen = torch.Generator().manual_seed(1)
    w1, s1, w2, s2, _, _ = _experts(512, 384, 6, "cpu", 1)
    x = torch.randn(37, 512, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, 6, (37, 2), generator=gen)
    w = torch.rand(37, 2, generator=gen)
    q, s = quantize_groups(x.to(dev))
    qr, sr = quantize_groups_reference(x)
    quant_equal = bool(torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s.cpu(), sr))
    got = fp8_moe.triton_fp8_moe_forward(*(t.to(dev) for t in (x, ids, w, w1, s1, w2, s2))).cpu()
    want = fp8_moe_reference(x, ids, w, w1, s1, w2, s2)
    rel = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    print(f"gpu check: activation quantization bitwise = {quant_equal}; fp8 block vs torch block math: rel max "
          f"err {rel:.2e}", flush=True)
    out = dict(quant_bitwise=quant_equal, block_rel_err=rel)
    from dwdp_runtime.kernels import fp8_cute

    why = fp8_cute.unavailable() if dev != "cpu" else "CPU"
    if why is None:
        cute = fp8_cute.cute_fp8_moe_forward(*(t.to(dev) for t in (x, ids, w, w1, s1, w2, s2))).cpu()
        out["cute_block_rel_err"] = float((cute.float() - want.float()).abs().max() / want.float().abs().max())
        out["cute_vs_triton_rel"] = float((cute.float() - got.float()).abs().max() / got.float().abs().max())
        print(f"gpu check: cute block vs torch block math: rel max err {out['cute_block_rel_err']:.2e}; vs the "
              f"Triton block {out['cute_vs_triton_rel']:.2e}", flush=True)
    else:
        out["cute_skipped"] = why
    return out


#: the side-by-side ratios a round yields (FP8 ÷ bf16 TFLOP/s, FP8 block ÷ bf16 block): what ``--rounds`` summarizes
ROUND_RATIOS = ("fp8_over_bf16_tflops", "fp8_block_over_bf16_block", "cute_over_bf16_tflops",
                "cute_plain_over_bf16_tflops", "cute_block_over_bf16_block")


def summarize_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Median and range of each ratio over rounds, per (shape, tokens). A ratio is formed inside its round (both
    sides measured back to back), so the GPU's clock and thermal state between rounds cancels in each; the median
    of rounds is what the docs quote (one round moves by ±5-10 % on H200)."""
    import statistics

    summary = []
    for rows in zip(*rounds):
        shape, tokens = rows[0]["shape"], rows[0]["tokens"]
        if any((r["shape"], r["tokens"]) != (shape, tokens) for r in rows):
            raise ValueError("rounds disagree on their rows")
        entry = dict(shape=shape, tokens=tokens, rounds=len(rows))
        for key in ROUND_RATIOS:
            values = [r[key] for r in rows if key in r]
            if values:
                entry[key] = dict(median=statistics.median(values), min=min(values), max=max(values))
        summary.append(entry)
    return summary


def _print_summary(summary: list[dict]) -> None:
    for entry in summary:
        parts = [f"{key} {v['median']:.3f} ({v['min']:.3f}-{v['max']:.3f})" for key, v in entry.items()
                 if isinstance(v, dict)]
        print(f"[{entry['shape']}] T={entry['tokens']}: median of {entry['rounds']} rounds: " + ", ".join(parts),
              flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["deepseek_v3", "qwen3_30b"], choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--no-tune", action="store_true", help="use the default fp8 tiles")
    p.add_argument("--tune-tokens", nargs="+", type=int, default=[16384],
                   help="token counts whose load bucket gets tuned tiles (others use the default table)")
    p.add_argument("--rep-ms", type=int, default=50)
    p.add_argument("--cute-configs", nargs="*", default=["128:n:1:2"],
                   help="CuTe GEMM configs to time, N[:m|n][:swizzle][:cluster_n] (none: skip the CuTe path)")
    p.add_argument("--no-triton", action="store_true",
                   help="skip the Triton FP8 kernels (their tuning, GEMMs and block): the CuTe path and the bf16 "
                        "references only, for less device time")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every shape this many times over and report each ratio's median and range")
    p.add_argument("--trace", action="store_true",
                   help="after each round's CuTe rows, run the default GEMMs once in the trace build and print where "
                        "each role's SM cycles go (waits for a stage, for its wgmma, the epilogue)")
    p.add_argument("--json", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU self-test of this script (TRITON_INTERPRET=1, tiny shape)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    import torch

    if a.smoke:
        rounds = [run_shape("tiny", [64], tune=False, rep_ms=1, smoke=True, with_triton=not a.no_triton)
                  for _ in range(a.rounds)]
        out = {"check": gpu_check("cpu"), "rows": [row for r in rounds for row in r], "summary": summarize_rounds(rounds)}
        print(json.dumps(out)[:300])
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
        return 0
    if not torch.cuda.is_available():
        print("bench/fp8_moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "check": gpu_check(), "rows": [],
           "summary": []}
    for name in a.shapes:
        rounds = []
        for i in range(a.rounds):
            if a.rounds > 1:
                print(f"[{name}] round {i + 1} of {a.rounds}", flush=True)
            rounds.append(run_shape(name, a.tokens, tune=not a.no_tune and i == 0, rep_ms=a.rep_ms,
                                    tune_tokens=a.tune_tokens, cute_configs=a.cute_configs,
                                    with_triton=not a.no_triton, trace=a.trace))
            out["rows"] += [dict(row, round=i) for row in rounds[-1]]
        if a.rounds > 1:
            out["summary"] += summarize_rounds(rounds)
            _print_summary(out["summary"][-len(rounds[0]):])
        if a.json:  # after every shape: a run cut short keeps what it measured
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
