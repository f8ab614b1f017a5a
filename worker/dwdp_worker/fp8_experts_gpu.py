"""CUDA path of the FP8 experts forward: the block-scaled Triton grouped GEMM over the bound composites.

``available(x)`` is True only on CUDA with Triton importable and the kernels present; everything else takes
``quant_loading.dequantized_forward`` (the reference path).
"""

from __future__ import annotations


def available(hidden_states) -> bool:
    if hidden_states.device.type != "cuda":
        return False
    try:
        from dwdp_runtime.kernels import fp8_moe  # noqa: F401
    except ImportError:
        return False
    return True


def forward(module, hidden_states, top_k_index, top_k_weights):
    from dwdp_runtime.kernels import fp8_moe

    pairs, _ = module._dwdp_fp8
    (w1, s1, segs1), (w2, s2, _) = pairs
    p = module._parameters
    return fp8_moe.fp8_moe_forward(hidden_states, top_k_index, top_k_weights, p[w1], p[s1], p[w2], p[s2],
                                   gate_split=segs1[0] if len(segs1) == 2 else None,
                                   act=getattr(module, "act_fn", None))
