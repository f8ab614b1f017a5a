"""One MoE experts block, side by side in one run: `transformers` grouped_mm, DWDP's Triton kernels, and the floor.

For every (shape, T):
  * ``transformers``  — a real ``Qwen3MoeExperts`` module on ``experts_implementation="grouped_mm"``
                        (sort, gather, ``torch._grouped_mm`` ×2, masks, SiLU·mul, weight, un-permute, sum);
  * ``ours``          — ``experts_impl.dwdp_experts_forward`` on the same module (routing alignment, GEMM 1
                        with gather + SiLU·mul, GEMM 2 with the routing weight, fixed-order reduction);
  * ``floor``         — the block's two grouped GEMMs alone through ``torch._grouped_mm`` on pre-sorted,
                        pre-gathered rows (what the block cannot beat with these GEMMs);
  * ``our GEMMs``     — our two kernels alone on a prepared routing plan (same work as the floor).
Ratios ``ours ÷ floor`` and ``transformers ÷ floor``, TFLOP/s of each (FLOPs = 6·T·k·H·I: gate_up
4·T·k·H·I + down 2·T·k·H·I; routing and reduction count zero), ``our GEMMs ÷ _grouped_mm`` speed, and
max |Δ| of ours vs `transformers` (bf16). Uniform random routing (softmax of Gaussian router logits,
top-k). Our configs are tuned once per (shape, T) before timing (``--no-tune``: the default table).

Run on a GPU:   python bench/moe_kernels.py                     (both shapes, T = 1K, 4K, 16K, 32K)
                python bench/moe_kernels.py --shapes qwen3 --tokens 4096 16384 --json out.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import asdict, dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@dataclass(frozen=True)
class BlockShape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int


SHAPES = {
    "qwen3": BlockShape("qwen3", 2048, 768, 128, 8),          # Qwen3-MoE-30B-A3B per-layer experts
    "dsv3": BlockShape("dsv3", 7168, 2048, 64, 8),            # DeepSeek-V3 expert shape, 64 of its 256 experts
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384, 32768])
    p.add_argument("--rep-ms", type=int, default=200, help="timing window per measurement (do_bench rep)")
    p.add_argument("--no-tune", action="store_true", help="use the default config table, no warm-up tuning")
    p.add_argument("--wide", action="store_true", help="tune over the wider candidate set (stages, swizzle)")
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--quant", choices=("fp8",), default=None,
                   help="fp8: the FP8 block-scaled kernels vs bf16 (bench/fp8_moe.py, same shapes and T)")
    return p.parse_args(argv)


def experts_module(shape: BlockShape, device, seed: int = 0):
    """A real transformers experts module of ``shape``, bf16, weights randn/sqrt(fan_in)."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=shape.hidden, moe_intermediate_size=shape.inter, num_experts=shape.experts,
                         num_experts_per_tok=shape.top_k, experts_implementation="grouped_mm")
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name in ("gate_up_proj", "down_proj"):
        meta = getattr(mod, name)
        t = torch.randn(meta.shape, device=device, generator=gen, dtype=torch.bfloat16) * meta.shape[-1] ** -0.5
        setattr(mod, name, torch.nn.Parameter(t, requires_grad=False))
    return mod


def routed_inputs(shape: BlockShape, tokens: int, device, seed: int = 1):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, shape.experts, device=device, generator=gen)
    w, ids = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)
    return x, ids, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


def floor_fn(mod, x, ids):
    """The two grouped GEMMs alone (torch._grouped_mm) on rows already sorted and gathered."""
    import torch

    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    rows = x[order // ids.shape[1]].contiguous()
    counts = torch.bincount(flat, minlength=mod.num_experts)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    w1, w2 = mod.gate_up_proj.transpose(-2, -1), mod.down_proj.transpose(-2, -1)
    inter = mod.down_proj.shape[-1]
    act = torch.empty(rows.shape[0], inter, device=x.device, dtype=x.dtype).normal_()

    def run():
        torch._grouped_mm(rows, w1, offs=offs)
        torch._grouped_mm(act, w2, offs=offs)

    return run


def our_gemms_fn(mod, x, ids, w):
    from dwdp_runtime.kernels import moe, tuning
    from dwdp_worker.model.experts_impl import layout_of, weights_of

    layout = layout_of(mod)
    weights = weights_of(mod, layout)
    p = moe._plan(x.shape[0], ids.shape[1], weights, layout, x.dtype)
    cfg1 = tuning.config_for(p.key1)
    cfg2 = tuning.with_block_m(tuning.config_for(p.key2), cfg1.block_m)
    plan, act = moe._stage1(x, ids, weights, layout, p, cfg1)
    from dwdp_runtime.kernels.grouped_gemm import down, gate_up

    def run():
        gate_up(x, weights.gate_up, plan, cfg1, inter=p.inter, w_strides=moe._nk_strides(weights.gate_up, False),
                up_offset=p.up_offset, col_step=p.col_step, has_gate=True)
        down(act, weights.down, w, plan, cfg2, hidden=p.hidden, w_strides=moe._nk_strides(weights.down, False))

    return run, (cfg1, cfg2)


def bench_one(shape: BlockShape, tokens: int, args, device) -> dict:
    import torch
    import triton.testing

    from dwdp_runtime.kernels import moe
    from dwdp_worker.model import experts_impl

    mod = experts_module(shape, device)
    x, ids, w = routed_inputs(shape, tokens, device)
    sweep = {}
    if not args.no_tune:
        layout = experts_impl.layout_of(mod)
        res = moe.tune_experts(experts_impl.weights_of(mod, layout), layout, top_k=shape.top_k,
                               token_counts=[tokens], rep_ms=25, wide=args.wide)[tokens]
        sweep = {g: sorted(([c.block_m, c.block_n, c.num_warps, c.num_stages, c.group_m, int(c.tma), round(ms, 4)] for c, ms in times.items()),
                           key=lambda r: r[-1])
                 for g, times in (("gate_up", res.gate_up_ms), ("down", res.down_ms))}

    def bench(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median"))

    with torch.inference_mode():
        theirs = mod(x, ids, w)
        ours = experts_impl.dwdp_experts_forward(mod, x, ids, w)
        diff = (ours.float() - theirs.float()).abs().max().item()
        scale = theirs.float().abs().max().item()
        t_tf = bench(lambda: mod(x, ids, w))
        t_ours = bench(lambda: experts_impl.dwdp_experts_forward(mod, x, ids, w))
        t_floor = bench(floor_fn(mod, x, ids))
        gemms, (cfg1, cfg2) = our_gemms_fn(mod, x, ids, w)
        t_gemms = bench(gemms)
    flops = 6 * tokens * shape.top_k * shape.hidden * shape.inter
    tflops = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
    return dict(shape=shape.name, tokens=tokens, transformers_ms=t_tf, ours_ms=t_ours, floor_ms=t_floor,
                our_gemms_ms=t_gemms, ours_over_floor=t_ours / t_floor, transformers_over_floor=t_tf / t_floor,
                gemm_speed_vs_grouped_mm=t_floor / t_gemms, tflops_transformers=tflops(t_tf),
                tflops_ours=tflops(t_ours), tflops_floor=tflops(t_floor), tflops_our_gemms=tflops(t_gemms),
                max_abs_diff=diff, max_abs_ref=scale, gate_up_config=asdict(cfg1), down_config=asdict(cfg2),
                sweep=sweep)


#: this bench's shape names -> bench/fp8_moe.py's
_FP8_SHAPES = {"qwen3": "qwen3_30b", "dsv3": "deepseek_v3"}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quant == "fp8":
        from bench.fp8_moe import main as fp8_main

        return fp8_main(["--shapes", *(_FP8_SHAPES[s] for s in args.shapes), "--tokens", *map(str, args.tokens),
                         "--rep-ms", str(args.rep_ms), *(["--no-tune"] if args.no_tune else []),
                         *(["--json", args.json] if args.json else [])])
    import torch

    if not torch.cuda.is_available():
        print("bench/moe_kernels.py: needs a CUDA GPU (the kernels are Triton on CUDA)", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    rows = []
    hdr = (f"{'shape':>6} {'T':>6} {'tf ms':>7} {'ours ms':>8} {'floor ms':>8} {'gemms ms':>8} {'ours/floor':>10} "
           f"{'tf/floor':>8} {'gemm spd':>8} {'TF/s ours':>9} {'TF/s floor':>10} {'TF/s gemms':>10} {'max|d|':>8}")
    for name in args.shapes:
        for t in args.tokens:
            r = bench_one(SHAPES[name], t, args, device)
            rows.append(r)
            print(f"{r['shape']} T={t}: {r}", flush=True)
            torch.cuda.empty_cache()
    print()
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['shape']:>6} {r['tokens']:>6} {r['transformers_ms']:>7.3f} {r['ours_ms']:>8.3f} {r['floor_ms']:>8.3f} "
              f"{r['our_gemms_ms']:>8.3f} {r['ours_over_floor']:>10.3f} {r['transformers_over_floor']:>8.3f} "
              f"{r['gemm_speed_vs_grouped_mm']:>8.3f} {r['tflops_ours']:>9.0f} {r['tflops_floor']:>10.0f} "
              f"{r['tflops_our_gemms']:>10.0f} {r['max_abs_diff']:>8.3g}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
