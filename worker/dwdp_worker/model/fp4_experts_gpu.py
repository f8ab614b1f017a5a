"""CUDA path of the FP4 experts forward: W4A8 or the weight-only FP4 Triton grouped GEMMs over the bound packed
composites (``kernels.w4a8_moe.chosen_kernel``: ``DWDP_FP4_KERNEL``, default ``auto``).

``unsupported_reason(module, x)`` is None only on CUDA with the Triton kernels available, 16-bit activations
and a module the fused epilogues cover: the default gate with a known activation, or a clamped SwiGLU the module's
own ``_apply_gate`` is found to compute (``kernels.gates.match``: gpt-oss's, DeepSeek-V4's; fused in both the
weight-only kernels and W4A8's Triton FP8 kernels), no post-expert norm, no expert-parallel sentinels; biases are fine. Anything else takes
``checkpoint.fp4_loading.dequantized_forward`` (dequantize, then the module's configured forward).

What the kernels read (``dwdp_runtime.kernels.fp4_moe``): the packed ``[E, out, in/2]`` codes and scales as the
hooks bound them (DWDP's composites; no copy), the layout flags ``@use_experts_implementation`` sets
(``has_gate``, ``is_concatenated``, ``has_bias``; the packed weights are ``[out, in]`` whatever
``is_transposed`` says), the activation from ``config.hidden_act``. Weight-only equals the bf16 kernels on the
dequantized weights bitwise (tests/kernels/test_fp4_kernels.py); W4A8 is the FP8 block-scaled MoE on the
re-encoded weights (tests/kernels/test_fp4_fp8.py). Either way a sharded FP4 model on GPU equals its unsharded
self on the same kernels (the choice depends on the checkpoint and the variable, never on the batch or rank).
"""

from __future__ import annotations

#: the experts module attribute holding what the FP4 forward reads (``checkpoint.fp4_loading.Fp4Experts``: the
#: format, the projections' packed weight and scale names), set with the forward by ``model.attach``
FP4_STATE_ATTR = "_dwdp_fp4"
#: activation dtypes the kernels run on CUDA (bf16/fp16 MMA with fp32 accumulation)
_DTYPES = ("torch.bfloat16", "torch.float16")


def _flags(module) -> tuple[bool, bool, bool, str]:
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    return (bool(getattr(module, "has_gate", True)), bool(getattr(module, "is_concatenated", True)),
            bool(getattr(module, "has_bias", False)), str(act))


def clamped_glu(module):
    """The ``ClampedGlu`` a custom ``_apply_gate`` computes (``experts_impl.clamped_glu`` on the packed rows)."""
    from .experts_impl import clamped_glu as glu_of

    return glu_of(module, _flags(module)[1])


def unsupported_reason(module, hidden_states) -> str | None:
    from dwdp_runtime import kernels

    from .experts_impl import has_custom_gate

    if hidden_states.device.type != "cuda" or not kernels.available(hidden_states.device):
        return f"FP4 Triton kernels unavailable on {hidden_states.device}"
    if str(hidden_states.dtype) not in _DTYPES:
        return f"activations in {hidden_states.dtype}"
    if getattr(module, "_is_expert_parallel", False) or getattr(module, "has_post_expert_norm", False):
        return "expert-parallel sentinels or post-expert norm"
    custom = has_custom_gate(module)
    if custom and clamped_glu(module) is None:
        return f"custom gate {type(module).__name__}._apply_gate (not a clamped SwiGLU the kernels fuse)"
    if not custom and _flags(module)[3] not in kernels.ACTIVATIONS:
        return f"activation {_flags(module)[3]!r}"
    return None


def forward(module, hidden_states, top_k_index, top_k_weights):
    from dwdp_runtime.kernels.fp4_moe import Fp4Weights, fp4_experts
    from dwdp_runtime.kernels.moe import ExpertsLayout
    from dwdp_runtime.contract import Fp4Kernel
    from dwdp_runtime.kernels.w4a8_moe import chosen_kernel, w4a8_experts

    spec = getattr(module, FP4_STATE_ATTR)
    up, down = spec.projections
    p = module._parameters
    has_gate, concatenated, has_bias, activation = _flags(module)
    second = (lambda proj: p[proj.scales[1]]) if len(up.scales) > 1 else (lambda proj: None)
    weights = Fp4Weights(str(getattr(spec.format, "value", spec.format)), p[up.weight], p[up.scales[0]],
                         p[down.weight], p[down.scales[0]], second(up), second(down),
                         p[f"{up.weight}_bias"] if has_bias else None, p[f"{down.weight}_bias"] if has_bias else None)
    glu = clamped_glu(module)
    layout = ExpertsLayout(has_gate=has_gate, is_concatenated=concatenated, has_bias=has_bias,
                           activation="silu" if glu is not None else activation, glu=glu)
    if chosen_kernel(weights, layout, hidden_states.device) is Fp4Kernel.W4A8:
        return w4a8_experts(hidden_states, top_k_index, top_k_weights, weights, layout)
    return fp4_experts(hidden_states, top_k_index, top_k_weights, weights, layout)
