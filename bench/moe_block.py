"""The MoE block INCLUDING its router, ÷ the block's two-GEMM floor (reports, never asserts; issue #34 "small T").

For every (shape, T), side by side in one process:
  * ``tf router + ours`` — what the model runs today: `transformers`' router module (gate GEMM, softmax or
    DeepSeek-V3's sigmoid/group-limited top-k, renormalisation) then our experts (``dwdp_experts_forward``);
  * ``fused``            — ``kernels.moe.moe_block``: the gate GEMM, the fused router (one launch, chunk counts
    included), the 3 remaining alignment kernels, our two GEMMs and the reduction;
  * ``floor``            — the two grouped GEMMs alone (``torch._grouped_mm`` on pre-sorted rows,
    ``bench/moe_kernels.floor_fn``), the number issue #34's goals divide by;
  * ``router`` columns   — the routers alone (gate GEMM included): `transformers`' vs the fused one.
With ``--cuda-graphs`` every one of them (the floor too) is also captured in a CUDA graph and timed by replay — how
the server runs a forward by default (docs/SERVING.md): the host's launch gaps, which dominate at 1K–4K tokens
eagerly, are gone from both sides of the ratio; the ``graphed`` columns print beside the eager ones.
Printed: ms of each, ``÷ floor`` of both blocks (goals: ≤ 1.3× at 4K and ≤ 1.15× at 16K for Qwen3, ≤ 1.1× for
DeepSeek-V3), the experts chosen by both routers (same set %), and max |Δ| fused vs `transformers` block.

Shapes: Qwen3-30B-A3B (H 2048, I 768, 128 experts, top-8, softmax) and the DeepSeek-V3 expert shape (H 7168,
I 2048, top-8, sigmoid + bias, 8 groups keep 4) over ``--dsv3-experts`` experts (default 64, as
bench/moe_kernels.py; 256 is the real model).

``--tiles`` times the fused block instead under each of ``TILE_CANDIDATES``' tilings (forced through
``tuning.remember``), eager and graphed, ÷ the floor, and checks every tiling's output is bitwise the first's (one
BLOCK_K per GEMM: the tiling never changes a bit) — the A/B behind ``tuning.default_config``'s load boundaries.

Run on a GPU:   python bench/moe_block.py [--tokens 1024 4096 16384] [--tiles] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.moe_kernels import BlockShape, experts_module, floor_fn  # noqa: E402


@dataclass(frozen=True)
class RouterShape:
    score: str            # softmax | sigmoid
    num_group: int = 1
    topk_group: int = 1
    scale: float = 1.0


SHAPES = {"qwen3": (BlockShape("qwen3", 2048, 768, 128, 8), RouterShape("softmax")),
          "dsv3": (BlockShape("dsv3", 7168, 2048, 64, 8), RouterShape("sigmoid", 8, 4, 2.5))}


def router_module(shape: BlockShape, rs: RouterShape, device):
    """`transformers`' router of the shape, bf16 weights (DeepSeek-V3 computes its logits in fp32 anyway)."""
    import torch

    if rs.score == "softmax":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        mod = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=shape.hidden, num_experts=shape.experts,
                                                num_experts_per_tok=shape.top_k, norm_topk_prob=True))
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        mod = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=shape.hidden, n_routed_experts=shape.experts,
                                                    n_group=rs.num_group, topk_group=rs.topk_group,
                                                    num_experts_per_tok=shape.top_k, routed_scaling_factor=rs.scale))
    mod = mod.to(device).eval()
    gen = torch.Generator(device=device).manual_seed(7)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen, device=device) * shape.hidden ** -0.5)
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.copy_(0.02 * torch.randn(shape.experts, generator=gen, device=device))
    mod = mod.to(torch.bfloat16)
    if hasattr(mod, "e_score_correction_bias"):  # fp32 in DeepSeek-V3's checkpoints
        mod.e_score_correction_bias.data = mod.e_score_correction_bias.data.float()
    return mod


#: calls per ``--profile`` table: per-kernel times averaged over a few blocks
PROFILE_CALLS = 20

@dataclass
class BlockCase:
    """One (shape, T) of the bench: `transformers`' experts and router modules with seeded weights, the views our
    kernels read, and the seeded input."""
    shape: BlockShape
    experts: Any
    gate: Any
    layout: Any
    weights: Any
    spec: Any
    bias: Any
    x: Any

    def fused(self):
        """``kernels.moe.moe_block``: gate GEMM, fused router, alignment, our two GEMMs, reduction."""
        from dwdp_runtime.kernels.moe import moe_block

        return moe_block(self.x, self.gate.weight, self.spec, self.weights, self.layout, bias=self.bias)


def block_case(name: str, tokens: int, args, device) -> BlockCase:
    import torch

    from dwdp_runtime.kernels import router
    from dwdp_worker.model import experts_impl

    shape, rs = SHAPES[name]
    if name == "dsv3" and args.dsv3_experts != shape.experts:
        shape = BlockShape("dsv3", shape.hidden, shape.inter, args.dsv3_experts, shape.top_k)
    experts = experts_module(shape, device)
    gate = router_module(shape, rs, device)
    layout = experts_impl.layout_of(experts)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16,
                    generator=torch.Generator(device=device).manual_seed(tokens))
    return BlockCase(shape, experts, gate, layout, experts_impl.weights_of(experts, layout),
                     router.of_module(gate, torch.bfloat16), getattr(gate, "e_score_correction_bias", None), x)


def median_ms(fn, rep_ms: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


#: ``--tiles`` candidates: (row block, GEMM 1 columns, GEMM 2 columns, warps) forced on both GEMMs of the fused
#: block — the default table's two mid/large-load tilings and their neighbours, for the load where one hands over
#: to the other (Qwen3 at 4K tokens and DeepSeek-V3's 64-expert shape at 2K are exactly 256 rows per expert)
TILE_CANDIDATES = ((64, 64, 128, 4), (64, 128, 128, 4), (128, 64, 128, 4), (128, 64, 256, 8),
                   (128, 128, 128, 8), (128, 128, 256, 8))


def tile_ab(name: str, tokens: int, args, device) -> list[dict]:
    """The fused block (router included) under each ``TILE_CANDIDATES`` tiling, eager and replayed from a CUDA
    graph, ÷ the same floor, side by side in one process; the default table's choice is marked."""
    import torch

    from dwdp_runtime.kernels import tuning

    case = block_case(name, tokens, args, device)
    shape, experts, gate, x, fused_block = case.shape, case.experts, case.gate, case.x, case.fused
    load = tuning.load_bucket(tokens, shape.top_k, shape.experts)
    keys = (tuning.ShapeKey("gate_up", shape.inter, shape.hidden, shape.experts, shape.top_k, "bfloat16", load),
            tuning.ShapeKey("down", shape.hidden, shape.inter, shape.experts, shape.top_k, "bfloat16", load))
    default = tuple(tuning.default_config(k) for k in keys)

    def bench(fn):
        return median_ms(fn, args.rep_ms)

    out = []
    with torch.inference_mode():
        _, _, ids = gate(x)
        floor = floor_fn(experts, x, ids)
        t_floor, g_floor = bench(floor), bench(graphed(floor, device))
        reference = None
        for bm, n1, n2, warps in TILE_CANDIDATES:
            # weight tiles through TMA where the default table would use it for 128-row tiles at this load
            cfgs = tuple(tuning.GemmConfig(block_m=bm, block_n=n, num_warps=warps, num_stages=4,
                                           tma=bm == 128 and tuning.default_config(k).tma)
                         for n, k in ((n1, keys[0]), (n2, keys[1])))
            tuning.forget_all()
            for key, cfg in zip(keys, cfgs):
                tuning.remember(key, cfg)
            try:
                y = fused_block()
                t_eager, t_graph = bench(fused_block), bench(graphed(fused_block, device))
            except Exception as exc:  # noqa: BLE001 - a tiling that cannot compile or launch is reported
                print(f"{name} T={tokens} tiles {bm}x{n1}/{n2} w{warps}: failed: {exc}", flush=True)
                continue
            reference = y if reference is None else reference
            same = bool(torch.equal(y, reference))
            is_default = cfgs == default
            row = dict(shape=name, experts=shape.experts, tokens=tokens, load=load, block_m=bm, gate_up_n=n1,
                       down_n=n2, warps=warps, default=is_default, eager_ms=t_eager, graphed_ms=t_graph,
                       eager_over_floor=t_eager / t_floor, graphed_over_floor=t_graph / g_floor,
                       bitwise_same_as_first=same)
            out.append(row)
            print(f"{name} E={shape.experts} T={tokens} load={load} tiles {bm}x{n1}/{n2} w{warps}"
                  f"{' (default)' if is_default else ''}: eager {t_eager:.3f} ms (÷floor {row['eager_over_floor']:.3f}),"
                  f" graphed {t_graph:.3f} ms (÷floor {row['graphed_over_floor']:.3f}); bitwise = first: {same}",
                  flush=True)
        tuning.forget_all()
    return out


def bench_one(name: str, tokens: int, args, device) -> dict:
    import torch

    from dwdp_runtime.kernels import router
    from dwdp_worker.model import experts_impl

    case = block_case(name, tokens, args, device)
    shape, experts, gate, spec, bias, x, fused_block = (case.shape, case.experts, case.gate, case.spec, case.bias,
                                                         case.x, case.fused)

    def tf_block():
        _, w, ids = gate(x)
        return experts_impl.dwdp_experts_forward(experts, x, ids, w)

    def fused_router():
        logits = (torch.nn.functional.linear(x.float(), gate.weight.float()) if spec.score == "sigmoid"
                  else torch.nn.functional.linear(x, gate.weight))
        return router.route(logits, spec, bias)

    def bench(fn):
        return median_ms(fn, args.rep_ms)

    with torch.inference_mode():
        _, w_tf, ids_tf = gate(x)
        got = fused_router()
        same = (torch.sort(ids_tf.long(), -1).values == torch.sort(got.topk_ids.long(), -1).values).all(-1)
        want, mine = tf_block(), fused_block()
        diff = (mine.float() - want.float()).abs().max().item()
        _, _, ids_floor = gate(x)
        floor = floor_fn(experts, x, ids_floor)
        t_tf, t_fused = bench(tf_block), bench(fused_block)
        t_floor = bench(floor)
        t_rtf, t_rfused = bench(lambda: gate(x)), bench(fused_router)
        row = dict(shape=name, experts=shape.experts, tokens=tokens, tf_router_ours_ms=t_tf, fused_ms=t_fused,
                   floor_ms=t_floor, tf_over_floor=t_tf / t_floor, fused_over_floor=t_fused / t_floor,
                   router_tf_ms=t_rtf, router_fused_ms=t_rfused, same_experts_pct=100.0 * same.float().mean().item(),
                   max_abs_diff=diff, max_abs_ref=want.float().abs().max().item())
        if args.profile:
            from bench.profiling import profile_table

            for label, fn in (("fused block", fused_block), ("floor", floor)):
                res = profile_table(lambda: [fn() for _ in range(PROFILE_CALLS)], device, rows=14)
                print(f"--- {name} T={tokens} {label}: {PROFILE_CALLS} calls, device busy "
                      f"{res.device_busy_s * 1e3 / PROFILE_CALLS:.3f} ms per call\n{res.table}", flush=True)
        if args.cuda_graphs:
            try:
                g_tf, g_fused, g_floor = (bench(graphed(fn, device)) for fn in (tf_block, fused_block, floor))
            except RuntimeError as exc:  # a block that cannot be captured is reported, not fatal to the run
                print(f"{name} T={tokens}: CUDA graph capture failed: {exc}", flush=True)
                return row
            row.update(graphed_tf_ms=g_tf, graphed_fused_ms=g_fused, graphed_floor_ms=g_floor,
                       graphed_tf_over_floor=g_tf / g_floor, graphed_fused_over_floor=g_fused / g_floor)
    return row


def graphed(fn, device):
    """``fn`` captured in a CUDA graph (after warm-up calls on a side stream, as torch requires): its replay."""
    import torch

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384])
    p.add_argument("--dsv3-experts", type=int, default=64)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="also time every block captured in a CUDA graph (the server's default)")
    p.add_argument("--profile", action="store_true",
                   help="print the kernel table of the fused block and of the floor (torch.profiler)")
    p.add_argument("--tiles", action="store_true",
                   help="instead: the fused block under each TILE_CANDIDATES tiling (A/B of the default table)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench/moe_block.py: needs a CUDA GPU (the kernels are Triton on CUDA)", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    rows = []
    if args.tiles:
        for name in args.shapes:
            for t in args.tokens:
                rows.extend(tile_ab(name, t, args, device))
                torch.cuda.empty_cache()
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    for name in args.shapes:
        for t in args.tokens:
            rows.append(bench_one(name, t, args, device))
            r = rows[-1]
            print(f"{name} E={r['experts']} T={t}: tf-router+ours {r['tf_router_ours_ms']:.3f} ms "
                  f"(÷floor {r['tf_over_floor']:.3f}), fused {r['fused_ms']:.3f} ms (÷floor {r['fused_over_floor']:.3f}), "
                  f"floor {r['floor_ms']:.3f} ms; router tf {r['router_tf_ms']:.3f} / fused {r['router_fused_ms']:.3f} ms; "
                  f"same experts {r['same_experts_pct']:.2f} %, max|Δ| {r['max_abs_diff']:.3g} (|ref| {r['max_abs_ref']:.3g})"
                  + (f"; graphed: tf-router+ours ÷floor {r['graphed_tf_over_floor']:.3f}, fused ÷floor "
                     f"{r['graphed_fused_over_floor']:.3f} (floor {r['graphed_floor_ms']:.3f} ms)"
                     if "graphed_floor_ms" in r else ""), flush=True)
            torch.cuda.empty_cache()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
