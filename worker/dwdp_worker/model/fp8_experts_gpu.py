"""CUDA path of the FP8 experts forward: the block-scaled Triton grouped GEMMs over the bound composites.

``unsupported_reason(module, x)`` is None only on CUDA with the Triton kernels available and a module the
fused epilogue covers (as ``experts_impl.unsupported_reason`` for bf16: default gate, a known activation, no
biases, no post-expert norm, no expert-parallel sentinels); anything else takes
``quant_loading.dequantized_forward`` (dequantize, then the module's configured bf16 forward).

The module's layout flags are read as ``@use_experts_implementation`` sets them (``has_gate``, ``has_bias``;
the activation from ``config.hidden_act``); transposed or interleaved FP8 experts were refused at load.
"""

from __future__ import annotations

#: the experts module attribute holding ``((weight, scale, row segments) names per GEMM, compute dtype)``,
#: set with the FP8 forward by ``model.attach`` (``checkpoint.quant_loading.fp8_override``)
FP8_STATE_ATTR = "_dwdp_fp8"


def _flags(module) -> tuple[bool, bool, str]:
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    return bool(getattr(module, "has_gate", True)), bool(getattr(module, "has_bias", False)), str(act)


def unsupported_reason(module, hidden_states) -> str | None:
    from dwdp_runtime import kernels
    from transformers.integrations import moe

    if hidden_states.device.type != "cuda" or not kernels.available(hidden_states.device):
        return f"FP8 Triton kernels unavailable on {hidden_states.device}"
    _, has_bias, activation = _flags(module)
    if has_bias:
        return "per-expert biases"
    if getattr(module, "_is_expert_parallel", False) or getattr(module, "has_post_expert_norm", False):
        return "expert-parallel sentinels or post-expert norm"
    if type(module)._apply_gate is not moe._default_apply_gate:
        return f"custom gate {type(module).__name__}._apply_gate"
    if activation not in kernels.ACTIVATIONS:
        return f"activation {activation!r}"
    return None


def forward(module, hidden_states, top_k_index, top_k_weights):
    from dwdp_runtime.kernels.fp8_moe import fp8_moe_forward

    pairs, _ = getattr(module, FP8_STATE_ATTR)
    (w1, s1, _), (w2, s2, _) = pairs
    p = module._parameters
    has_gate, _, activation = _flags(module)
    return fp8_moe_forward(hidden_states, top_k_index, top_k_weights, p[w1], p[s1], p[w2], p[s2],
                           has_gate=has_gate, activation=activation)
