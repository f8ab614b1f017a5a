"""DWDP's experts forward for `transformers`: the model keeps its graph, the routed-experts math is ours.

``register()`` adds ``"dwdp"`` to ``transformers.integrations.moe.ExpertsInterface`` (a class-wide
registry in both transformers 5.17 and 5.24: ``ExpertsInterface.register(name, fn)``; a model then picks
it with ``model.set_experts_implementation("dwdp")``, which validates the name against that registry).
Every experts module decorated with ``@use_experts_implementation`` (Qwen3-MoE, Mixtral, DeepSeek-V3, …)
then calls ``dwdp_experts_forward(module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.
The router, DeepSeek-V3's group-limited routing and its shared experts stay in the model, untouched.

What the forward runs (``dwdp_experts_forward``):
  * the Triton kernels of ``dwdp_runtime.kernels`` (``fused_experts``) when they support the module and the
    input — a CUDA device (or Triton's CPU interpreter), 16-bit weights, a gate/activation the fused
    epilogue implements, no post-expert norm, no expert parallelism — reading the module's weights as
    bound (DWDP's composite ``[E, N, K]`` views: pointer + strides, no copy);
  * otherwise `transformers`' own ``grouped_mm`` experts forward, unchanged (so a CPU run stays bitwise
    with plain `transformers`).

The weight layout comes from the flags ``@use_experts_implementation`` sets on each module (``has_gate``,
``is_transposed``, ``is_concatenated``, ``has_bias``): the same description the model registry discovers,
so a new architecture with a layout the kernels cover needs no code here.

``select(model, device, requested)`` is the engine's choice: ``"auto"`` → ``"dwdp"`` on CUDA when the
kernels are available and the architecture is supported, else the model's default (``grouped_mm``).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: the name the forward is registered under in transformers' ExpertsInterface
IMPL_NAME = "dwdp"
#: the choices ``select`` accepts
CHOICES: tuple[str, ...] = ("auto", IMPL_NAME, "grouped_mm", "eager")
#: weight dtypes the Triton GEMMs run (bf16/fp16 tensor-core MMA with fp32 accumulation)
_KERNEL_DTYPES = ("torch.bfloat16", "torch.float16")

_registered = False


def layout_of(module: Any):
    """The ``ExpertsLayout`` of a `transformers` experts module (from its interface flags)."""
    from dwdp_runtime.kernels.moe import ExpertsLayout

    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    return ExpertsLayout(has_gate=bool(getattr(module, "has_gate", True)),
                         is_transposed=bool(getattr(module, "is_transposed", False)),
                         is_concatenated=bool(getattr(module, "is_concatenated", True)),
                         has_bias=bool(getattr(module, "has_bias", False)), activation=str(act))


def weights_of(module: Any, layout):
    from dwdp_runtime.kernels.moe import ExpertWeights

    up = module.gate_up_proj if layout.has_gate else module.up_proj
    bias = (module.gate_up_proj_bias if layout.has_gate else module.up_proj_bias) if layout.has_bias else None
    return ExpertWeights(gate_up=up, down=module.down_proj, gate_up_bias=bias,
                         down_bias=module.down_proj_bias if layout.has_bias else None)


def unsupported_reason(module: Any, hidden_states: Any) -> str | None:
    """Why the kernels cannot run this module on this input (None when they can)."""
    from dwdp_runtime import kernels
    from transformers.integrations import moe

    if not kernels.available(hidden_states.device):
        return f"Triton kernels unavailable on {hidden_states.device}"
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel sentinels"
    if getattr(module, "has_post_expert_norm", False):
        return "post-expert norm"
    if type(module)._apply_gate is not moe._default_apply_gate:
        return f"custom gate {type(module).__name__}._apply_gate"
    layout = layout_of(module)
    if layout.activation not in kernels.ACTIVATIONS:
        return f"activation {layout.activation!r}"
    w = module.gate_up_proj if layout.has_gate else module.up_proj
    if hidden_states.device.type == "cuda" and str(w.dtype) not in _KERNEL_DTYPES:
        return f"weights in {w.dtype}"
    return None


def dwdp_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts forward registered as ``"dwdp"`` (see module docstring)."""
    reason = unsupported_reason(self, hidden_states)
    if reason is not None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    from dwdp_runtime.kernels.moe import fused_experts

    layout = layout_of(self)
    return fused_experts(hidden_states, top_k_index, top_k_weights, weights_of(self, layout), layout)


def register() -> None:
    """Add ``"dwdp"`` to transformers' ExpertsInterface (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPL_NAME, dwdp_experts_forward)
    _registered = True


def _device_type(device: Any) -> str:
    import torch

    return torch.device(device).type if device is not None else "cpu"


def select(model: Any, device: Any, requested: str = "auto") -> str:
    """Set ``model``'s experts implementation and return the name in use.

    ``auto``: ``dwdp`` on CUDA when Triton is there and the model is one of the supported architectures;
    otherwise the model keeps its default (CPU stays bitwise with plain `transformers`)."""
    from dwdp_runtime import kernels

    from .models import SUPPORTED_ARCHS

    if requested not in CHOICES:
        raise ValueError(f"experts implementation {requested!r} is not one of {', '.join(CHOICES)}")
    name = requested
    if requested == "auto":
        arch = getattr(model.config, "model_type", None)
        on_cuda = _device_type(device) == "cuda"
        name = IMPL_NAME if on_cuda and arch in SUPPORTED_ARCHS and kernels.available(device) else None
        if name is None:
            return str(model.config._experts_implementation)
    if name == IMPL_NAME:
        register()
    model.set_experts_implementation(name)
    log.info("experts implementation: %s", name)
    return name
