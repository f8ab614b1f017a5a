"""gpt-oss's MXFP4 experts on the GPU: the FP4 paths with the clamped SwiGLU fused (``kernels.gates``) — W4A8
(the default) and weight-only — ÷ the dequantizing forward they replace and ÷ bf16 kernels (reports; issue #31).

Until the clamped gate had an epilogue, a gpt-oss (or DeepSeek-V4) FP4 layer on CUDA ran
``checkpoint.fp4_loading.dequantized_forward``: every expert of the layer dequantized to bf16, then the module's
own `transformers` forward. Here, side by side in one process on a real ``GptOssExperts`` module at gpt-oss's
expert shape (hidden 2880, intermediate 2880, top-4) over ``--experts`` experts: that fallback, the module's forward
(``model.fp4_experts_gpu.forward``: interleaved rows, biases, α-scaled SwiGLU + 1) under ``DWDP_FP4_KERNEL`` =
``weight-only`` (the FP4 kernels) and ``w4a8`` (re-encoded to e4m3 blocks, the Triton FP8 kernels with the bias
and clamp epilogues — the CuTe ones take neither), and the bf16 kernels on the dequantized weights with the same
epilogue; ms, the ratios, and max |Δ| of each against the fallback.

Run on a GPU:   python bench/clamped_fp4.py [--tokens 1024 4096] [--experts 32] [--json out.json]
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

#: gpt-oss-20b/120b expert shape: hidden and intermediate size, experts per token
HIDDEN, INTER, TOP_K = 2880, 2880, 4


def gpt_oss_module(experts: int, device):
    """A ``GptOssExperts`` holding MXFP4 composites (quantized from seeded weights) as the loader binds them."""
    import torch
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from dwdp_runtime.quant import QuantFormat, fp4
    from dwdp_worker.checkpoint.fp4_layout import Fp4Experts, Fp4Projection
    from dwdp_worker.model import fp4_experts_gpu

    cfg = transformers.GptOssConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=experts,
                                    num_experts_per_tok=TOP_K, num_hidden_layers=1)
    module = GptOssExperts(cfg).to(device)
    g = torch.Generator(device=device).manual_seed(0)
    w1 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g, device=device) * HIDDEN ** -0.5 * 3
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g, device=device) * INTER ** -0.5
    (q1, s1), (q2, s2) = fp4.mxfp4_quantize(w1), fp4.mxfp4_quantize(w2)
    b1 = (0.5 * torch.randn(experts, 2 * INTER, generator=g, device=device)).to(torch.bfloat16)
    b2 = (0.1 * torch.randn(experts, HIDDEN, generator=g, device=device)).to(torch.bfloat16)
    for name, value in (("gate_up_proj", q1), ("gate_up_proj_scales", s1), ("down_proj", q2),
                        ("down_proj_scales", s2), ("gate_up_proj_bias", b1), ("down_proj_bias", b2)):
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    spec = Fp4Experts(QuantFormat.MXFP4, (Fp4Projection("gate_up_proj", ("gate_up_proj_scales",), (2 * INTER,), True),
                                          Fp4Projection("down_proj", ("down_proj_scales",), (HIDDEN,), True)),
                      torch.bfloat16)
    setattr(module, fp4_experts_gpu.FP4_STATE_ATTR, spec)
    return module, (q1, s1, q2, s2, b1, b2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)

    import torch
    import triton.testing

    import os

    from dwdp_runtime.contract import TuningEnv
    from dwdp_runtime.kernels import gates
    from dwdp_runtime.kernels.moe import ExpertsLayout, ExpertWeights, fused_experts
    from dwdp_runtime.quant import fp4
    from dwdp_worker.checkpoint.fp4_loading import dequantized_forward
    from dwdp_worker.model import fp4_experts_gpu

    if not torch.cuda.is_available():
        print("bench/clamped_fp4.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    module, (q1, s1, q2, s2, b1, b2) = gpt_oss_module(args.experts, dev)
    glu = fp4_experts_gpu.clamped_glu(module)
    probe = torch.zeros(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    print(f"gpt-oss experts x{args.experts}: matched gate {glu}; kernels cover it: "
          f"{fp4_experts_gpu.unsupported_reason(module, probe) is None}", flush=True)
    twin = ExpertWeights(fp4.mxfp4_dequantize(q1, s1, torch.bfloat16), fp4.mxfp4_dequantize(q2, s2, torch.bfloat16),
                         b1, b2)
    layout = ExpertsLayout(is_concatenated=False, has_bias=True, glu=glu or gates.ClampedGlu(7.0, 1.702, 1.0))
    bench = lambda fn: float(triton.testing.do_bench(fn, warmup=5, rep=args.rep_ms, return_mode="median"))  # noqa: E731
    rows = []
    with torch.inference_mode():
        for t in args.tokens:
            g = torch.Generator(device=dev).manual_seed(t)
            x = torch.randn(t, HIDDEN, device=dev, dtype=torch.bfloat16, generator=g)
            w, ids = torch.topk(torch.rand(t, args.experts, device=dev, generator=g), TOP_K, dim=-1)
            w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
            fallback = dequantized_forward(module, x, ids, w)
            t_fallback = bench(lambda: dequantized_forward(module, x, ids, w))
            t_bf16 = bench(lambda: fused_experts(x, ids, w, twin, layout))
            row = dict(tokens=t, experts=args.experts, dequantizing_ms=t_fallback, bf16_kernels_ms=t_bf16)
            line = [f"T={t}: dequantizing forward {t_fallback:.3f} ms | bf16 kernels, same epilogue {t_bf16:.3f} ms"]
            for kernel in ("weight-only", "w4a8"):
                os.environ[TuningEnv.FP4_KERNEL] = kernel
                out = fp4_experts_gpu.forward(module, x, ids, w)
                ms = bench(lambda: fp4_experts_gpu.forward(module, x, ids, w))
                diff = float((out.float() - fallback.float()).abs().max() / fallback.float().abs().max())
                key = kernel.replace("-", "_")
                row.update({f"{key}_ms": ms, f"{key}_over_bf16_kernels": t_bf16 / ms,
                            f"{key}_speedup_over_dequantizing": t_fallback / ms,
                            f"{key}_max_rel_diff_vs_dequantizing": diff})
                line.append(f"{kernel} {ms:.3f} ms = {t_bf16 / ms:.2f}x bf16, {t_fallback / ms:.1f}x the "
                            f"dequantizing forward, max rel |Δ| {diff:.3g}")
            os.environ.pop(TuningEnv.FP4_KERNEL)
            rows.append(row)
            print(" | ".join(line), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
