"""Prefill throughput, DWDP-sharded vs unsharded, measured side by side in one run (reports, never asserts).

  1. write (or reuse) a synthetic MoE checkpoint sized so that experts dominate and everything fits one H200
     (default: Qwen3-MoE, 8 layers, hidden 2048, 64 experts x moe_intermediate 768, top-8, bf16 ≈ 5 GB);
  2. start ``--dwdp-size`` rank processes (rank r on ``cuda:(r % --gpus)``), each builds a DWDP ``Engine``;
  3. rank 0 also loads the unsharded model with plain ``transformers`` (``oracle.Reference``) on its device;
  4. rank 0 alternates sharded / unsharded forwards of one ``--isl``-token sequence (warm-up first), the other
     ranks stay idle holding their handles (peers of one GPU would otherwise compete for its SMs);
  5. prints a table: tokens/s of each, the ratio sharded ÷ unsharded, exposed prefetch wait, restarts, and the
     max |Δlogits| between the two (a correctness sanity check, bf16), and the MFU of each.

``--experts-impl`` picks the experts forward of BOTH models (``auto``: DWDP's Triton kernels on CUDA,
``grouped_mm``: plain `transformers`); with DWDP's experts on CUDA both models also run the fused RMSNorm
and RoPE (``--layers all``, as the engine does; ``norms`` / ``none`` for an A/B); ``--num-heads`` sets the
attention heads (default hidden/128).

MFU = model FLOPs of one forward ÷ time ÷ ``--peak-tflops`` (790: the dense bf16 matrix rate measured on
this H200, docs/KERNELS.md). Model FLOPs (``prefill_flops``; multiply-add = 2 FLOPs; sequences of length L
packed into T = Σ L tokens):
  * attention projections  2·T·H·(n_q·d + 2·n_kv·d) + 2·T·(n_q·d)·H per layer (DeepSeek-V3: its MLA
    low-rank q/kv down- and up-projections and o_proj);
  * causal attention        2·n_q·(d_qk + d_v)·L(L+1)/2 per sequence per layer (QKᵀ and PV, lower triangle);
  * routed experts          6·T·k·H·I per MoE layer (gate_up 4·T·k·H·I, down 2·T·k·H·I);
  * router                  2·T·H·E per MoE layer;
  * dense MLPs              6·T·H·I_dense per dense layer; DeepSeek-V3 shared experts 6·T·H·I·n_shared;
  * lm_head apart: only the last position of each sequence is projected (``logits_to_keep``), not counted.

Run on a GPU:   python bench/prefill.py --isl 8192 --dwdp-size 4
CPU smoke test: python bench/prefill.py --device cpu --isl 256 --hidden-size 64 --num-experts 8 --num-layers 2 \
                    --moe-intermediate-size 64 --vocab-size 512 --iters 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from dwdp_runtime.contract import DEFAULT_TRANSFER, TRANSFER_MODES  # noqa: E402 - stdlib only, after the path set-up
from bench.ranks import spawn_ranks, sync_device  # noqa: E402

#: ``--layers`` choices: which fused non-expert layers (worker/dwdp_worker/model/layers_impl.py) stay installed
LAYER_CHOICES = ("all", "norms", "none")


def apply_layers(model, choice: str) -> None:
    """Keep the fused layers ``choice`` names on a model the engine's selection gave all of them (DWDP experts
    on CUDA); other models are left alone. RoPE is process-wide: apply the same choice to every model."""
    from dwdp_worker.model import layers_impl

    if choice == "all" or model.config._experts_implementation != "dwdp" or model.device.type != "cuda":
        return
    layers_impl.uninstall(model)
    if choice == "norms":
        layers_impl.install(model, rope=False)


def build_parser(doc: str = __doc__) -> argparse.ArgumentParser:
    """The model/run options (bench/prefill_layers.py adds its own to the same parser)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    p.add_argument("--model", help="checkpoint directory (default: write a synthetic one under --work-dir)")
    p.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "deepseek_v3"))
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dwdp-bench"))
    p.add_argument("--isl", type=int, default=8192, help="input sequence length (tokens)")
    p.add_argument("--batch", type=int, default=1, help="sequences of --isl tokens packed in one forward")
    p.add_argument("--dwdp-size", type=int, default=4)
    p.add_argument("--gpus", type=int, default=1, help="GPUs to spread the ranks over (rank r on cuda:r%%gpus)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--iters", type=int, default=5, help="timed forwards of each kind (after 2 warm-ups)")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=2048)
    p.add_argument("--num-experts", type=int, default=64)
    p.add_argument("--moe-intermediate-size", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--slots", type=int, default=2, help="num_prefetch_slots")
    p.add_argument("--transfer", choices=TRANSFER_MODES, default=DEFAULT_TRANSFER,
                   help="how peer pages are copied (on ONE GPU copy_engine runs as SM kernels; batched is "
                        "driven like a copy engine: docs/DRIVER_FACTS.md)")
    p.add_argument("--num-heads", type=int, default=None, help="attention heads (default hidden/128, at least 2)")
    p.add_argument("--experts-impl", default="auto", choices=("auto", "dwdp", "grouped_mm", "eager"),
                   help="experts forward of both models (auto: DWDP's Triton kernels on CUDA)")
    p.add_argument("--layers", default="all", choices=LAYER_CHOICES,
                   help="fused non-expert layers of both models with DWDP's experts on CUDA (all: RMSNorm + RoPE, "
                        "what the engine runs; norms: RMSNorm only; none: transformers' own)")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak for MFU (measured H200)")
    p.add_argument("--timeout", type=float, default=1800.0, help="rendezvous timeout (s)")
    p.add_argument("--cuda-graphs", type=int, default=0, metavar="N",
                   help="both models replayed from CUDA graphs as the worker does (padded buckets, "
                        "rank/prefill_graphs.py; the sharded engine with cuda_graphs=N); 0: eager (default)")
    p.add_argument("--quant", choices=("fp8",), default=None,
                   help="fp8: an FP8 block-scaled checkpoint (bench/fp8_prefill.py: sharded vs unsharded FP8, "
                        "agreement with the dequantized bf16 model)")
    p.add_argument("--fp8-dense", action="store_true",
                   help="with --quant fp8: the sharded engine keeps the dense linears FP8 (DWDP_FP8_DENSE=on)")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def ensure_model(args) -> pathlib.Path:
    if args.model:
        return pathlib.Path(args.model)
    from dwdp_worker.checkpoint.synth import write_synthetic

    heads = args.num_heads or max(2, args.hidden_size // 128)
    name = (f"{args.arch}-L{args.num_layers}-H{args.hidden_size}-E{args.num_experts}-I{args.moe_intermediate_size}"
            f"-k{args.top_k}-V{args.vocab_size}-{args.dtype}-P{args.isl}-h{heads}")
    out = pathlib.Path(args.work_dir) / name
    if not (out / "config.json").is_file():
        print(f"writing synthetic checkpoint {out} ...", flush=True)
        write_synthetic(args.arch, out, seed=0, num_experts=args.num_experts, num_layers=args.num_layers,
                        hidden_size=args.hidden_size, vocab_size=args.vocab_size, dtype=args.dtype,
                        moe_intermediate_size=args.moe_intermediate_size, intermediate_size=4 * args.hidden_size,
                        max_positions=max(args.isl, 4096), top_k=args.top_k,
                        num_heads=heads)
    return out


def rank_main(rank: int, args, model_dir: str, port: int, q) -> None:
    try:
        q.put((rank, run_rank(rank, args, model_dir, port)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        q.put((rank, {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))


def run_rank(rank: int, args, model_dir: str, port: int) -> dict:
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.rendezvous import StoreRendezvous
    from dwdp_worker.rank.engine import Engine, num_experts_of

    device = f"cuda:{rank % args.gpus}" if args.device == "cuda" else "cpu"
    backend = "auto" if args.device == "cuda" else "host"
    if args.device == "cuda":
        torch.cuda.set_device(device)
    cfg = DwdpConfig.even(dwdp_size=args.dwdp_size, num_experts=num_experts_of(model_dir),
                          num_prefetch_slots=args.slots, transfer=args.transfer)
    gen = torch.Generator().manual_seed(1)
    with StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=args.dwdp_size, job="bench",
                         token="bench", timeout_s=args.timeout) as rdzv:
        engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend=backend,
                              device=device if args.device == "cuda" else None, token="bench",
                              progress=(rank == 0), experts=args.experts_impl, cuda_graphs=args.cuda_graphs)
        apply_layers(engine.model, args.layers)
        out: dict = {"local": engine.manager.local_range}
        try:
            if rank == 0:
                from dwdp_worker.launch.oracle import Reference

                ref = Reference(model_dir, device=device, experts=args.experts_impl)
                apply_layers(ref.model, args.layers)
                ref_logits = ref.logits
                if args.cuda_graphs:
                    from dwdp_worker.rank.prefill_graphs import PrefillGraphs

                    ref_graphs = PrefillGraphs(ref.model, device, max_graphs=args.cuda_graphs)
                    ref_logits = ref_graphs.logits
                seqs = [torch.randint(0, engine.vocab_size, (args.isl,), generator=gen).tolist()
                        for _ in range(args.batch)]
                tokens = args.isl * args.batch
                for _ in range(2):  # warm-up (kernels, allocator, the prefetch schedule)
                    engine.forward(seqs)
                    ref_logits(seqs)
                sharded, unsharded, waits = [], [], []
                diff = 0.0
                for _ in range(args.iters):
                    sync_device(device)
                    r = engine.forward(seqs)
                    sharded.append(r.compute_s)
                    waits.append(r.prefetch_wait_s)
                    sync_device(device)
                    t0 = time.perf_counter()
                    want = ref_logits(seqs)
                    unsharded.append(time.perf_counter() - t0)
                    diff = max(diff, (r.logits - want).abs().max().item())
                out.update(tokens=tokens, experts_impl=engine.model.config._experts_implementation, sharded_s=statistics.median(sharded),
                           unsharded_s=statistics.median(unsharded), wait_s=statistics.median(waits),
                           restarts=engine.manager.num_restarts, max_abs_diff=diff, stats=dataclasses.asdict(engine.stats()),
                           local_expert_bytes=engine.load_report.local_expert_bytes,
                           total_expert_bytes=engine.load_report.total_expert_bytes)
                if args.cuda_graphs:
                    out["ref_graphs"] = ref_graphs.counters.as_dict()
                    ref_graphs.close()
                del ref
            rdzv.barrier("bench/done")  # peers keep their handles mapped until rank 0 is done
        finally:
            engine.close()
    return out


def prefill_flops(config, seq_lens) -> dict:
    """Model FLOPs of one packed prefill forward, by part (see the module docstring for each formula).

    ``config``: the `transformers` config; which layers are MoE and how many experts they route over come
    from the model's discovered experts layout (``models.model_layout`` of the meta model), not a table."""
    import copy

    import torch

    from dwdp_worker.checkpoint.loader import build_meta_model
    from dwdp_worker.model.registry import model_layout

    layout = model_layout(build_meta_model(copy.deepcopy(config), torch.float32))

    def get(name, default=None):
        v = getattr(config, name, None)
        return default if v is None else v

    h, layers = config.hidden_size, config.num_hidden_layers
    t = sum(seq_lens)
    nq = config.num_attention_heads
    nkv = get("num_key_value_heads", nq)
    d = get("head_dim", h // nq)
    if config.model_type == "deepseek_v3":
        qk, dv, rope, lora = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim, \
            config.qk_rope_head_dim, config.kv_lora_rank
        q_lora = get("q_lora_rank")
        q = (2 * t * h * q_lora + 2 * t * q_lora * nq * qk) if q_lora else 2 * t * h * nq * qk
        kv = 2 * t * h * (lora + rope) + 2 * t * lora * nq * (config.qk_nope_head_dim + dv)
        proj = q + kv + 2 * t * nq * dv * h
    else:
        qk = dv = d
        proj = 2 * t * h * (nq * d + 2 * nkv * d) + 2 * t * nq * d * h
    attn = sum(2 * nq * (qk + dv) * n * (n + 1) // 2 for n in seq_lens)
    top_k = config.num_experts_per_tok
    inter = get("moe_intermediate_size") or config.intermediate_size
    moe_layers = len(layout.experts)
    dense_layers = layers - moe_layers
    shared = 6 * t * h * inter * get("n_shared_experts", 0)
    out = {"attention_projections": layers * proj, "attention": layers * attn,
           "routed_experts": moe_layers * 6 * t * top_k * h * inter,
           "router": moe_layers * 2 * t * h * (layout.num_experts if moe_layers else 0),
           "dense_mlp": dense_layers * 6 * t * h * get("intermediate_size", 0) + moe_layers * shared}
    out["total"] = sum(out.values())
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU machine, or pass --device cpu for a smoke test", file=sys.stderr)
            return 2
        args.gpus = max(1, min(args.gpus, torch.cuda.device_count()))
    if args.quant == "fp8":
        from bench.fp8_prefill import run as run_fp8

        return run_fp8(args)
    try:
        model_dir = ensure_model(args)
    except (ValueError, OSError) as exc:
        print(f"bench/prefill.py: error: {exc}", file=sys.stderr)
        return 2
    results = spawn_ranks(rank_main, args.dwdp_size, args, str(model_dir))
    if results is None:
        return 1
    r0 = results[0]
    tps_sharded, tps_unsharded = r0["tokens"] / r0["sharded_s"], r0["tokens"] / r0["unsharded_s"]
    print()
    print(f"model {model_dir.name}: experts {r0['total_expert_bytes'] / 2**30:.2f} GiB, "
          f"rank 0 holds [{r0['local'][0]}, {r0['local'][1]}) = {r0['local_expert_bytes'] / 2**30:.2f} GiB; "
          f"dwdp_size={args.dwdp_size} on {args.gpus if args.device == 'cuda' else 0} GPU(s), "
          f"remote bytes/forward {r0['stats']['remote_bytes_per_forward'] / 2**30:.2f} GiB")
    hdr = f"{'ISL':>6} {'tokens':>7} {'unsharded tok/s':>16} {'sharded tok/s':>14} {'ratio':>6} " \
          f"{'unsharded ms':>12} {'sharded ms':>10} {'wait ms':>8} {'restarts':>8} {'max|dlogit|':>11}"
    from dwdp_worker.checkpoint.loader import load_config

    flops = prefill_flops(load_config(model_dir), [args.isl] * args.batch)
    peak = args.peak_tflops * 1e12
    mfu_u, mfu_s = flops["total"] / r0["unsharded_s"] / peak, flops["total"] / r0["sharded_s"] / peak
    print(f"experts impl {r0['experts_impl']}, fused layers {args.layers}; model FLOPs/forward {flops['total'] / 1e12:.2f} T ("
          + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in flops.items() if k != "total") + ")")
    hdr += f" {'MFU unsh':>8} {'MFU sh':>6}"
    print(hdr)
    print("-" * len(hdr))
    print(f"{args.isl:>6} {r0['tokens']:>7} {tps_unsharded:>16.0f} {tps_sharded:>14.0f} "
          f"{tps_sharded / tps_unsharded:>6.3f} {r0['unsharded_s'] * 1e3:>12.2f} {r0['sharded_s'] * 1e3:>10.2f} "
          f"{r0['wait_s'] * 1e3:>8.2f} {r0['restarts']:>8} {r0['max_abs_diff']:>11.3g} {mfu_u:>8.1%} {mfu_s:>6.1%}")
    if args.cuda_graphs:
        print(f"CUDA graphs (--cuda-graphs {args.cuda_graphs}): sharded {r0['stats']['graphs']}, "
              f"unsharded {r0['ref_graphs']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
