"""FP4 experts on one GPU: weight-only FP4 grouped GEMMs vs bf16 ``torch._grouped_mm``, side by side, and the
bytes a DWDP prefetch moves per layer.

For each shape (DeepSeek-V3 experts: H 7168, I 2048, top-8, 64 of its 256 experts so the bf16 twin fits
beside; Qwen3-30B-A3B: H 2048, I 768, 128 experts, top-8; ``--shapes deepseek_v4``: H 4096, I 2048, top-6, 64 of
256, its SwiGLU clamped at 10 in every path — its FP4 decodes as MXFP4's, so ``--formats mxfp4``), FP4 format
(``mxfp4``, ``nvfp4``) and token count T, uniformly random routing, all in one run:

  * ``bf16 grouped_mm``  — ``torch._grouped_mm`` on expert-sorted rows of the dequantized bf16 weights, gate_up
                           then down (the floor the fused-kernel issue uses; no activation, gather or scatter);
  * ``fp4 GEMMs``        — the two weight-only FP4 grouped GEMMs alone (``fp4_gate_up`` incl. its act·mul
                           epilogue, ``fp4_down`` incl. the routing weight) on a prepared routing plan, in ``fp4_moe.fp4_configs``'
                           tiling: FP4 → bf16 in the weight load, bf16 MMA; ratio ``bf16 grouped_mm ÷ fp4 GEMMs`` (issue #31 asks
                           ≥ 1.0 at 16K for weight-only);
  * ``bf16 block`` / ``fp4 block`` — whole routed-experts forwards: ``kernels.fused_experts`` on the dequantized
                           weights vs ``kernels.fp4_moe.fp4_experts`` on the packed ones, and how close (the
                           decode is exact; on the GPU the sums run in another order: ``MAX_REL_DIFF``);
  * ``W4A8``             — ``kernels.w4a8_moe`` (GPU, CuTe DSL): the re-encoding of both projections to e4m3
                           128×128 blocks (``fp4_fp8``, once per layer per forward) timed alone, the two CuTe
                           block-scaled GEMMs on it alone (fused gate_up + down on prepared plan rows, as
                           bench/fp8_moe.py times them), their ratios to bf16 ``_grouped_mm`` without and with the
                           re-encoding, the whole W4A8 block (re-encoding included) ÷ the bf16 block — in line and
                           with the re-encoding one chunk ahead on a side stream (``DWDP_W4A8_OVERLAP=on``) —, and
                           its relative error against the bf16 block on the dequantized weights. Without CuTe DSL,
                           or with ``DWDP_FP8_BACKEND=triton``: the re-encoding and the whole W4A8 block on the
                           Triton FP8 kernels (the path of gpt-oss's and DeepSeek-V4's experts) ÷ the bf16 block;
  * ``prefetch bytes``   — bytes of one expert per layer, measured from the tensors themselves (packed codes +
                           scales; bf16 and FP8 twins beside), and what a d = 4 group's rank pulls per MoE layer
                           (the 3/4 of the model's experts it does not hold).

FLOPs of both GEMMs: ``6·T·k·H·I``. Times: CUDA events, median of ``do_bench`` (``--rounds R``: each ratio's
median and range over R rounds, each ratio formed inside its round).

    python bench/fp4_moe.py                          (both shapes, both formats, T = 4K and 16K)
    python bench/fp4_moe.py --formats nvfp4 --tokens 16384 --rounds 3 --json out.json
    python bench/fp4_moe.py --sweep --tokens 16384   (each FP4 GEMM alone under the SWEEP_* tilings)
    DWDP_FP4_GENERIC_DECODE=1 python bench/fp4_moe.py --sweep-first   (the generic float32 decode: "before")
    TRITON_INTERPRET=1 python bench/fp4_moe.py --smoke   (the script's own CPU test, tiny shape)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

SHAPES = {  # name: (hidden, moe_intermediate, experts here, top_k, the model's routed experts)
    "deepseek_v3": (7168, 2048, 64, 8, 256),
    "qwen3_30b": (2048, 768, 128, 8, 128),
    "deepseek_v4": (4096, 2048, 64, 6, 256),  # `transformers`' DeepseekV4Config defaults, its clamped silu below
    "tiny": (128, 64, 8, 2, 8),  # --smoke
}
#: shapes whose experts clamp their SwiGLU (``gates.ClampedGlu``): DeepSeek-V4's swiglu_limit 10
CLAMP_LIMITS = {"deepseek_v4": 10.0}


def layout_of(name: str):
    """The experts layout a shape's model has: DeepSeek-V4's clamped silu, else the plain SiLU gate."""
    from dwdp_runtime.kernels.gates import ClampedGlu
    from dwdp_runtime.kernels.moe import ExpertsLayout

    limit = CLAMP_LIMITS.get(name)
    return ExpertsLayout(glu=None if limit is None else ClampedGlu(limit))
FORMATS = ("mxfp4", "nvfp4")
#: the group a prefetch-bytes line describes: d ranks, each holding E/d experts and pulling the rest per layer
PREFETCH_GROUP = 4
RATIOS = ("fp4_over_bf16_grouped_mm", "fp4_block_over_bf16_block")
#: the W4A8 ratios, summarized where a round measured them
W4A8_RATIOS = ("w4a8_gemms_over_bf16_grouped_mm", "w4a8_with_reencode_over_bf16_grouped_mm",
               "w4a8_block_over_bf16_block", "w4a8_ahead_block_over_bf16_block")


#: on the GPU the FP4 kernels sum the same exact products in another order than the bf16 kernels (the decoded
#: weights are the MMA's A operand): outputs agree within a few bf16 ulps of the largest (2^-8 is one)
MAX_REL_DIFF = 4 * 2.0 ** -8

def experts(fmt, h, i, e, dev, seed=0):
    """Packed FP4 experts quantized from seeded weights (``Fp4Weights``) and their dequantized bf16 twins."""
    import torch

    from dwdp_runtime.kernels.fp4_moe import Fp4Weights
    from dwdp_runtime.kernels.moe import ExpertWeights
    from dwdp_runtime.quant import fp4

    g = torch.Generator(device=dev).manual_seed(seed)
    w1 = torch.randn(e, 2 * i, h, generator=g, device=dev) * h ** -0.5
    w2 = torch.randn(e, h, i, generator=g, device=dev) * i ** -0.5
    if fmt == "mxfp4":
        (q1, s1), (q2, s2) = fp4.mxfp4_quantize(w1), fp4.mxfp4_quantize(w2)
        return Fp4Weights(fmt, q1, s1, q2, s2), ExpertWeights(fp4.mxfp4_dequantize(q1, s1, torch.bfloat16),
                                                              fp4.mxfp4_dequantize(q2, s2, torch.bfloat16))
    (q1, s1, g1), (q2, s2, g2) = fp4.nvfp4_quantize(w1, row_segments=(i, i)), fp4.nvfp4_quantize(w2)
    return (Fp4Weights(fmt, q1, s1, q2, s2, g1, g2),
            ExpertWeights(fp4.nvfp4_dequantize(q1, s1, g1, torch.bfloat16, row_segments=(i, i)),
                          fp4.nvfp4_dequantize(q2, s2, g2, torch.bfloat16)))


def expert_bytes(tensors) -> int:
    """Bytes of one expert across ``tensors`` (each ``[E, ...]``), from the tensors' own sizes."""
    return sum(t[0].numel() * t.element_size() for t in tensors if t is not None)


def prefetch_bytes(name, packed, twin) -> dict:
    """One expert per layer in each format, and what a rank of a d = 4 group pulls per MoE layer."""
    from dwdp_runtime.quant import fp8_block

    i = twin.down.shape[2]
    q1, s1 = fp8_block.quantize(twin.gate_up[:1].float(), row_segments=(i, i))
    q2, s2 = fp8_block.quantize(twin.down[:1].float())
    per = {"bf16": expert_bytes((twin.gate_up, twin.down)), "fp8": expert_bytes((q1, s1, q2, s2)),
           packed.format: expert_bytes((packed.gate_up, packed.gate_up_scale, packed.gate_up_scale_2, packed.down,
                                        packed.down_scale, packed.down_scale_2))}
    model_experts = SHAPES[name][4]
    remote = model_experts - model_experts // PREFETCH_GROUP
    out = {f"{k}_expert_bytes": v for k, v in per.items()}
    out.update({f"{k}_prefetch_mib_per_layer": v * remote / 2**20 for k, v in per.items()})
    print(f"[{name}] {packed.format}: bytes per expert per layer " + ", ".join(f"{k} {v:,}" for k, v in per.items())
          + f"; a rank of d={PREFETCH_GROUP} pulls {remote} experts per MoE layer: "
          + ", ".join(f"{k} {v * remote / 2**20:.1f} MiB" for k, v in per.items())
          + f" ({per[packed.format] / per['bf16']:.3f} of bf16)", flush=True)
    return out


def run_shape(name, fmt, tokens, *, rep_ms: int, smoke: bool = False) -> list[dict]:
    import torch
    import triton.testing

    from dwdp_runtime.kernels import tuning
    from dwdp_runtime.kernels.fp4_grouped_gemm import fp4_down, fp4_gate_up
    from dwdp_runtime.kernels.fp4_moe import SCALE_FORMATS, fp4_configs, fp4_experts
    from dwdp_runtime.kernels.moe import fused_experts
    from dwdp_runtime.kernels.routing import align_routing

    h, i, e, k, _ = SHAPES[name]
    dev = torch.device("cpu" if smoke else "cuda")
    packed, twin = experts(fmt, h, i, e, dev)
    layout = layout_of(name)
    if smoke:
        bench = lambda fn: (fn(), 1.0)[1]  # noqa: E731 - runs every path once, times nothing
    else:
        bench = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))  # noqa: E731
    common = prefetch_bytes(name, packed, twin)
    rows = []
    for t in tokens:
        g = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
        w, ids = torch.topk(torch.rand(t, e, device=dev, generator=g), k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.float32)
        flops = 6 * t * k * h * i
        order = torch.sort(ids.flatten(), stable=True)
        xs = x[order.indices // k]
        offs = torch.cumsum(torch.bincount(order.values, minlength=e), 0).to(torch.int32)
        act_in = torch.randn(t * k, i, device=dev, dtype=torch.bfloat16, generator=g)
        if smoke:  # torch._grouped_mm is CUDA-only: the smoke run checks the rest
            t_bf16 = 1.0
        else:
            t_bf16 = bench(lambda: (torch._grouped_mm(xs, twin.gate_up.transpose(-2, -1), offs=offs),
                                    torch._grouped_mm(act_in, twin.down.transpose(-2, -1), offs=offs)))
        load = tuning.load_bucket(t, k, e)
        c1 = tuning.config_for(tuning.ShapeKey("gate_up", i, h, e, k, "bfloat16", load))
        c2 = tuning.with_block_m(tuning.config_for(tuning.ShapeKey("down", h, i, e, k, "bfloat16", load)), c1.block_m)
        c1, c2 = fp4_configs(c1, c2, load)
        plan = align_routing(ids, e, c1.block_m)
        fmt_code = SCALE_FORMATS[fmt]

        def gemm1():
            return fp4_gate_up(x, packed.gate_up, packed.gate_up_scale, packed.gate_up_scale_2, plan, c1, inter=i,
                               up_offset=i, col_step=1, has_gate=True, scale_fmt=fmt_code, glu=layout.glu)

        act = gemm1()
        t_g1 = bench(gemm1)
        t_g2 = bench(lambda: fp4_down(act, packed.down, packed.down_scale, packed.down_scale_2, w, plan, c2,
                                      hidden=h, scale_fmt=fmt_code))
        ref = fused_experts(x, ids, w, twin, layout)
        got = fp4_experts(x, ids, w, packed, layout)
        t_bblock = bench(lambda: fused_experts(x, ids, w, twin, layout))
        t_fblock = bench(lambda: fp4_experts(x, ids, w, packed, layout))
        r = dict(shape=name, format=fmt, tokens=t, hidden=h, inter=i, experts=e, top_k=k,
                 bf16_grouped_mm_ms=t_bf16, bf16_tflops=flops / t_bf16 / 1e9, fp4_gate_up_ms=t_g1, fp4_down_ms=t_g2,
                 fp4_gemms_ms=t_g1 + t_g2, fp4_tflops=flops / (t_g1 + t_g2) / 1e9,
                 fp4_over_bf16_grouped_mm=t_bf16 / (t_g1 + t_g2), bf16_block_ms=t_bblock, fp4_block_ms=t_fblock,
                 fp4_block_over_bf16_block=t_bblock / t_fblock, block_bitwise_equal=bool(torch.equal(got, ref)),
                 block_max_rel_diff=float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1)),
                 cfg_gate_up=str(c1), cfg_down=str(c2), **common)
        r.update(w4a8_row(name, fmt, packed, x, ids, w, ref, bench=bench, t_bf16=t_bf16, t_bblock=t_bblock,
                          flops=flops, layout=layout))
        rows.append(r)
        print(f"[{name}] {fmt} T={t}: bf16 grouped_mm {t_bf16:.3f} ms ({r['bf16_tflops']:.0f} TFLOP/s) | FP4 "
              f"weight-only GEMMs {t_g1 + t_g2:.3f} ms ({r['fp4_tflops']:.0f} TFLOP/s) = "
              f"{r['fp4_over_bf16_grouped_mm']:.2f}x bf16 | block bf16 {t_bblock:.3f} ms, fp4 {t_fblock:.3f} ms "
              f"({r['fp4_block_over_bf16_block']:.2f}x), bitwise {r['block_bitwise_equal']}, max rel diff "
              f"{r['block_max_rel_diff']:.2g}", flush=True)
    return rows


def w4a8_row(name, fmt, packed, x, ids, w, ref, *, bench, t_bf16, t_bblock, flops, layout) -> dict:
    """The W4A8 path at one shape (module docstring), or why it was skipped."""
    import torch

    from dwdp_runtime.kernels import fp8_cute
    from dwdp_runtime.kernels.fp4_fp8 import fp4_block_fp8, unpacked_columns
    from dwdp_runtime.kernels.fp8_plan_rows import gather_plan_rows
    from dwdp_runtime.kernels.fp8_quant import quantize_groups
    from dwdp_runtime.kernels.routing import align_routing
    from dwdp_runtime.kernels.fp8_moe import wanted_backend
    from dwdp_runtime.kernels.w4a8_moe import cute_refusal, unsupported, w4a8_experts

    why = unsupported(packed, layout, x.device)
    if why:
        print(f"[{name}] {fmt} T={x.shape[0]}: W4A8 skipped: {why}", flush=True)
        return dict(w4a8_skipped=why)
    i = unpacked_columns(packed.down)

    def reencode():
        return (fp4_block_fp8(packed.gate_up, packed.gate_up_scale, fmt, packed.gate_up_scale_2, split=i),
                fp4_block_fp8(packed.down, packed.down_scale, fmt, packed.down_scale_2))

    (w1, s1), (w2, s2) = reencode()
    t_conv = bench(reencode)
    forced = os.environ.get("DWDP_FP8_BACKEND", "").strip().lower() == "triton"
    on_triton = ("DWDP_FP8_BACKEND=triton" if forced else fp8_cute.unavailable(x.device)
                 or cute_refusal(packed, layout, wanted_backend()))   # where w4a8_experts itself goes
    if on_triton:   # the whole W4A8 block on the Triton FP8 kernels (where DeepSeek-V4's and gpt-oss's experts run)
        got = w4a8_experts(x, ids, w, packed, layout)
        t_block = bench(lambda: w4a8_experts(x, ids, w, packed, layout))
        r = dict(w4a8_backend="triton", w4a8_reencode_ms=t_conv, w4a8_block_ms=t_block,
                 w4a8_block_over_bf16_block=t_bblock / t_block,
                 w4a8_rel_err=float((got.float() - ref.float()).norm() / ref.float().norm()))
        print(f"[{name}] {fmt} T={x.shape[0]}: W4A8 on the Triton FP8 kernels ({on_triton}): re-encode "
              f"{t_conv:.3f} ms | block {t_block:.3f} ms = {r['w4a8_block_over_bf16_block']:.2f}x bf16 block | "
              f"rel err vs bf16 block {r['w4a8_rel_err']:.4f}", flush=True)
        return r
    plan = align_routing(ids, w1.shape[0], fp8_cute.TILE_M)
    a, sa = gather_plan_rows(*quantize_groups(x), plan)
    h, hs = fp8_cute.gate_up_act_quant(a, sa, w1, s1, plan.block_expert, i, glu=layout.glu)
    t1 = bench(lambda: fp8_cute.gate_up_act_quant(a, sa, w1, s1, plan.block_expert, i, glu=layout.glu))
    t2 = bench(lambda: fp8_cute.block_scaled_grouped_gemm(h, hs, w2, s2, plan.block_expert))
    got = w4a8_experts(x, ids, w, packed, layout)
    t_block = bench(lambda: w4a8_experts(x, ids, w, packed, layout))

    os.environ["DWDP_W4A8_OVERLAP"] = "on"   # the re-encoding one chunk ahead on a side stream (w4a8_reencode)
    try:
        ahead_bitwise = bool(torch.equal(w4a8_experts(x, ids, w, packed, layout), got))
        t_ahead = bench(lambda: w4a8_experts(x, ids, w, packed, layout))
    finally:
        os.environ.pop("DWDP_W4A8_OVERLAP")
    r = dict(w4a8_reencode_ms=t_conv, w4a8_gate_up_ms=t1, w4a8_down_ms=t2, w4a8_gemms_ms=t1 + t2,
             w4a8_tflops=flops / (t1 + t2) / 1e9, w4a8_gemms_over_bf16_grouped_mm=t_bf16 / (t1 + t2),
             w4a8_with_reencode_over_bf16_grouped_mm=t_bf16 / (t_conv + t1 + t2), w4a8_block_ms=t_block,
             w4a8_block_over_bf16_block=t_bblock / t_block, w4a8_ahead_block_ms=t_ahead,
             w4a8_ahead_block_over_bf16_block=t_bblock / t_ahead, w4a8_ahead_bitwise=ahead_bitwise,
             w4a8_rel_err=float((got.float() - ref.float()).norm() / ref.float().norm()))
    print(f"[{name}] {fmt} T={x.shape[0]}: W4A8 re-encode {t_conv:.3f} ms + GEMMs {t1 + t2:.3f} ms "
          f"({r['w4a8_tflops']:.0f} TFLOP/s; fused gate_up {t1:.3f}, down {t2:.3f}) = "
          f"{r['w4a8_gemms_over_bf16_grouped_mm']:.2f}x bf16 grouped_mm ({r['w4a8_with_reencode_over_bf16_grouped_mm']:.2f}x "
          f"with the re-encode) | block {t_block:.3f} ms = {r['w4a8_block_over_bf16_block']:.2f}x bf16 block, "
          f"re-encoding ahead {t_ahead:.3f} ms = {r['w4a8_ahead_block_over_bf16_block']:.2f}x (bitwise {ahead_bitwise}) | "
          f"rel err vs bf16 block {r['w4a8_rel_err']:.4f}", flush=True)
    return r


#: ``--sweep``: FP4 tilings timed per GEMM (block_m, block_n, block_k, num_warps, num_stages)
SWEEP_GATE_UP = ((128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4),
                 (128, 128, 128, 8, 3), (128, 64, 128, 4, 3), (128, 64, 64, 4, 3), (256, 64, 64, 8, 4),
                 (128, 32, 64, 4, 4))
SWEEP_DOWN = ((128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
              (128, 128, 128, 8, 3), (256, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4))


def sweep(name, fmt, tokens, *, rep_ms: int, only_first: bool = False) -> list[dict]:
    """Each FP4 GEMM alone under each tiling of ``SWEEP_*`` (a plan per block_m), beside bf16 ``_grouped_mm``."""
    import torch
    import triton.testing

    from dwdp_runtime.kernels.fp4_grouped_gemm import fp4_down, fp4_gate_up
    from dwdp_runtime.kernels.fp4_moe import SCALE_FORMATS
    from dwdp_runtime.kernels.routing import align_routing
    from dwdp_runtime.kernels.tuning import GemmConfig

    h, i, e, k, _ = SHAPES[name]
    dev = torch.device("cuda")
    packed, twin = experts(fmt, h, i, e, dev)
    bench = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))  # noqa: E731
    out = []
    for t in tokens:
        g = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
        w, ids = torch.topk(torch.rand(t, e, device=dev, generator=g), k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(torch.float32)
        order = torch.sort(ids.flatten(), stable=True)
        xs = x[order.indices // k]
        offs = torch.cumsum(torch.bincount(order.values, minlength=e), 0).to(torch.int32)
        act_in = torch.randn(t * k, i, device=dev, dtype=torch.bfloat16, generator=g)
        t_g1 = bench(lambda: torch._grouped_mm(xs, twin.gate_up.transpose(-2, -1), offs=offs))
        t_g2 = bench(lambda: torch._grouped_mm(act_in, twin.down.transpose(-2, -1), offs=offs))
        fmt_code = SCALE_FORMATS[fmt]
        plans = {}
        best = {}
        for gemm, grid, ref in (("gate_up", SWEEP_GATE_UP, t_g1), ("down", SWEEP_DOWN, t_g2)):
            for bm, bn, bk, nw, ns in (grid[:1] if only_first else grid):
                cfg = GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                plan = plans.setdefault(bm, align_routing(ids, e, bm))
                act = torch.randn(plan.sorted_pairs.numel(), i, device=dev, dtype=torch.bfloat16, generator=g)
                if gemm == "gate_up":
                    fn = lambda: fp4_gate_up(x, packed.gate_up, packed.gate_up_scale, packed.gate_up_scale_2, plan,  # noqa: E731
                                             cfg, inter=i, up_offset=i, col_step=1, has_gate=True, scale_fmt=fmt_code)
                else:
                    fn = lambda: fp4_down(act, packed.down, packed.down_scale, packed.down_scale_2, w, plan, cfg,  # noqa: E731
                                          hidden=h, scale_fmt=fmt_code)
                try:
                    ms = bench(fn)
                except Exception as exc:  # a tiling that does not compile or fit: reported, not fatal
                    print(f"[{name}] {fmt} T={t} {gemm} {cfg}: failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                flops = 2 * t * k * h * i * (2 if gemm == "gate_up" else 1)
                row = dict(shape=name, format=fmt, tokens=t, gemm=gemm, cfg=(bm, bn, bk, nw, ns), ms=ms,
                           bf16_ms=ref, over_bf16=ref / ms, tflops=flops / ms / 1e9)
                out.append(row)
                if gemm not in best or ms < best[gemm]["ms"]:
                    best[gemm] = row
                print(f"[{name}] {fmt} T={t} {gemm} bm={bm} bn={bn} bk={bk} w={nw} s={ns}: {ms:.3f} ms "
                      f"({row['tflops']:.0f} TFLOP/s) = {ref / ms:.2f}x bf16 grouped_mm ({ref:.3f} ms)", flush=True)
        if len(best) == 2:
            tot = best["gate_up"]["ms"] + best["down"]["ms"]
            print(f"[{name}] {fmt} T={t}: best gate_up {best['gate_up']['cfg']} + down {best['down']['cfg']}: "
                  f"{tot:.3f} ms = {(t_g1 + t_g2) / tot:.2f}x bf16 grouped_mm ({t_g1 + t_g2:.3f} ms)", flush=True)
    return out


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """Median and range of each ratio over rounds, per (shape, format, T); each ratio formed inside its round."""
    out = []
    for rows in zip(*rounds):
        entry = {key: rows[0][key] for key in ("shape", "format", "tokens")}
        entry["rounds"] = len(rows)
        for key in RATIOS + tuple(k for k in W4A8_RATIOS if k in rows[0]):
            values = [r[key] for r in rows]
            entry[key] = dict(median=statistics.median(values), min=min(values), max=max(values))
        out.append(entry)
        print(f"[{entry['shape']}] {entry['format']} T={entry['tokens']}: median of {len(rows)} rounds: "
              + ", ".join(f"{k} {entry[k]['median']:.3f} ({entry[k]['min']:.3f}-{entry[k]['max']:.3f})"
                          for k in RATIOS + W4A8_RATIOS if k in entry), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3_30b", "deepseek_v3"], choices=list(SHAPES))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--rep-ms", type=int, default=50)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true", help="time each FP4 GEMM under the SWEEP_* tilings")
    p.add_argument("--sweep-first", action="store_true", help="--sweep with the first tiling of each GEMM only")
    p.add_argument("--smoke", action="store_true", help="CPU self-test (TRITON_INTERPRET=1, tiny shape)")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    import torch

    if a.smoke:
        rows = [row for fmt in a.formats for row in run_shape("tiny", fmt, [48], rep_ms=1, smoke=True)]
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
        return 0 if all(r["block_bitwise_equal"] for r in rows) else 1   # the interpreter: bitwise
    if not torch.cuda.is_available():
        print("bench/fp4_moe.py needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "summary": []}
    if a.sweep or a.sweep_first:
        out["sweep"] = [row for name in a.shapes for fmt in a.formats
                        for row in sweep(name, fmt, a.tokens, rep_ms=a.rep_ms, only_first=a.sweep_first)]
        if a.json:
            pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
        return 0
    for name in a.shapes:
        for fmt in a.formats:
            rounds = [run_shape(name, fmt, a.tokens, rep_ms=a.rep_ms) for _ in range(a.rounds)]
            out["rows"] += [dict(row, round=n) for n, rows in enumerate(rounds) for row in rows]
            if a.rounds > 1:
                out["summary"] += summarize(rounds)
            if a.json:  # after every (shape, format): a run cut short keeps what it measured
                pathlib.Path(a.json).write_text(json.dumps(out, indent=1))
    return 0 if all(r["block_max_rel_diff"] <= MAX_REL_DIFF for r in out["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
