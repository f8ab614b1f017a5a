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
    epilogue implements (the default gate with a known activation, or a clamped SwiGLU the module's own
    ``_apply_gate`` is found to compute: ``clamped_glu``, gpt-oss's and DeepSeek-V4's), no post-expert norm, no
    expert parallelism — reading the module's weights as bound (DWDP's composite ``[E, N, K]`` views: pointer +
    strides, no copy);
  * otherwise `transformers`' own ``grouped_mm`` experts forward, unchanged (so a CPU run stays bitwise
    with plain `transformers`).

The weight layout is the model registry's *discovered experts layout* (``experts_layout.ExpertsLayout``:
``has_gate``, ``is_transposed``, ``is_concatenated``, ``has_bias``, the sharded params and their roles):
``attach_layouts`` turns each module's entry into the kernels' ``ExpertsLayout`` once and keeps it on the module
(``_dwdp_kernels``); a module reached without ``attach`` reads the same flags from the interface's
attributes. A new architecture whose layout the kernels cover needs no code here. Quantized experts
(FP8 composites) never reach the bf16 kernels: their own forward (``quant_loading``) runs, and any weight
dtype other than 16-bit (fp32 too, under the CPU interpreter) falls back to grouped_mm.

``choose(model, device, requested)`` is the engine's choice (pure): ``"auto"`` → ``"dwdp"`` on CUDA when the
kernels are available and the architecture is supported, else the model's default (``grouped_mm``).
``model.attach`` applies it; with ``dwdp`` on CUDA it also swaps in the fused non-expert layers
(``layers_impl.install``: one-pass RMSNorm, one-launch RoPE), so the engine and the oracle, which both attach
through it, run the same kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

log = logging.getLogger(__name__)

#: the name the forward is registered under in transformers' ExpertsInterface
IMPL_NAME = "dwdp"
#: the choices ``choose`` accepts
CHOICES: tuple[str, ...] = ("auto", IMPL_NAME, "grouped_mm", "eager")
#: weight dtypes the Triton GEMMs run on CUDA (bf16/fp16 tensor-core MMA with fp32 accumulation);
#: the CPU interpreter also runs float32 (tests)
_KERNEL_DTYPES = ("torch.bfloat16", "torch.float16")

#: the experts module attribute holding its kernels' layout (set by ``attach_layouts``)
KERNELS_ATTR = "_dwdp_kernels"
#: the module attribute caching ``clamped_glu`` (one probe per module, on the CPU, never inside a capture)
_GLU_ATTR = "_dwdp_clamped_glu"
_UNMATCHED = "unmatched"

_registered = False


def kernel_layout(discovered: Any, activation: str):
    """The kernels' ``ExpertsLayout`` of one discovered ``experts_layout.ExpertsLayout`` (or any object with
    the interface's flags: ``has_gate``, ``is_transposed``, ``is_concatenated``, ``has_bias``)."""
    from dwdp_runtime.kernels.moe import ExpertsLayout

    return ExpertsLayout(has_gate=bool(getattr(discovered, "has_gate", True)),
                         is_transposed=bool(getattr(discovered, "is_transposed", False)),
                         is_concatenated=bool(getattr(discovered, "is_concatenated", True)),
                         has_bias=bool(getattr(discovered, "has_bias", False)), activation=str(activation))


def _activation(module: Any) -> str:
    return str(getattr(getattr(module, "config", None), "hidden_act", "silu"))


def layout_of(module: Any):
    """The kernels' ``ExpertsLayout`` of an experts module: the one ``attach_layouts`` set from the discovered
    layout, else the module's own interface flags."""
    attached = getattr(module, KERNELS_ATTR, None)
    return attached if attached is not None else kernel_layout(module, _activation(module))


def weights_of(module: Any, layout):
    from dwdp_runtime.kernels.moe import ExpertWeights

    up = module.gate_up_proj if layout.has_gate else module.up_proj
    bias = (module.gate_up_proj_bias if layout.has_gate else module.up_proj_bias) if layout.has_bias else None
    return ExpertWeights(gate_up=up, down=module.down_proj, gate_up_bias=bias,
                         down_bias=module.down_proj_bias if layout.has_bias else None)


def has_custom_gate(module: Any) -> bool:
    """The module's class replaces `transformers`' default ``_apply_gate`` (``act(gate) · up``)."""
    from transformers.integrations import moe

    return type(module)._apply_gate is not moe._default_apply_gate


def clamped_glu(module: Any, concatenated: bool | None = None):
    """The ``kernels.gates.ClampedGlu`` a custom ``_apply_gate`` computes (None: the default gate, or a gate the
    epilogue cannot fuse). ``concatenated``: the gate/up row layout (default: the module's own flag)."""
    from dwdp_runtime.kernels import gates

    if not has_custom_gate(module):
        return None
    cached = module.__dict__.get(_GLU_ATTR)
    if cached is None:
        if concatenated is None:
            concatenated = bool(getattr(module, "is_concatenated", True))
        cached = gates.match(module, concatenated) or _UNMATCHED
        module.__dict__[_GLU_ATTR] = cached
    return None if cached == _UNMATCHED else cached


def unsupported_reason(module: Any, hidden_states: Any) -> str | None:
    """Why the kernels cannot run this module on this input (None when they can)."""
    from dwdp_runtime import kernels

    if not kernels.available(hidden_states.device):
        return f"Triton kernels unavailable on {hidden_states.device}"
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel sentinels"
    if getattr(module, "has_post_expert_norm", False):
        return "post-expert norm"
    layout = layout_of(module)
    custom = has_custom_gate(module)
    if custom and clamped_glu(module, layout.is_concatenated) is None:
        return f"custom gate {type(module).__name__}._apply_gate (not a clamped SwiGLU the kernels fuse)"
    if not custom and layout.activation not in kernels.ACTIVATIONS:
        return f"activation {layout.activation!r}"
    w = module.gate_up_proj if layout.has_gate else module.up_proj
    allowed = _KERNEL_DTYPES if hidden_states.device.type == "cuda" else (*_KERNEL_DTYPES, "torch.float32")
    if str(w.dtype) not in allowed:
        return f"weights in {w.dtype}"
    return None


def dwdp_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts forward registered as ``"dwdp"`` (see module docstring)."""
    reason = unsupported_reason(self, hidden_states)
    if reason is not None:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index.long(), top_k_weights)
    from dwdp_runtime.kernels.moe import fused_experts

    from .router_impl import COUNTS_ATTR

    layout = layout_of(self)
    glu = clamped_glu(self, layout.is_concatenated)
    if glu is not None:
        layout = dataclasses.replace(layout, activation="silu", glu=glu)
    # the fused router's chunk counts ride on its index tensor (router_impl): the alignment then skips counting
    return fused_experts(hidden_states, top_k_index, top_k_weights, weights_of(self, layout), layout,
                         counts=getattr(top_k_index, COUNTS_ATTR, None))


def register() -> None:
    """Add ``"dwdp"`` to transformers' ExpertsInterface (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPL_NAME, dwdp_experts_forward)
    _registered = True


def attach_layouts(model: Any) -> list:
    """Give every experts module its kernels' layout (``KERNELS_ATTR``) from the model's discovered layout (the
    loader's ``model.dwdp_layout``, else ``registry.model_layout``); returns the modules (``attach`` undoes it)."""
    from . import registry

    layout = getattr(model, "dwdp_layout", None) or registry.model_layout(model)
    modules = []
    for e in layout.experts:
        module = model.get_submodule(e.path)
        setattr(module, KERNELS_ATTR, kernel_layout(e, _activation(module)))
        modules.append(module)
    return modules


def device_type(device: Any) -> str:
    import torch

    return torch.device(device).type if device is not None else "cpu"


def choose(model: Any, device: Any, requested: str = "auto") -> str:
    """The experts implementation ``model`` should run (pure: ``attach`` applies it).

    ``auto``: ``dwdp`` on CUDA when Triton is there and the model is one of the supported architectures;
    otherwise the model's own (CPU stays bitwise with plain `transformers`)."""
    from dwdp_runtime import kernels

    from .registry import SUPPORTED_ARCHS

    if requested not in CHOICES:
        raise ValueError(f"experts implementation {requested!r} is not one of {', '.join(CHOICES)}")
    if requested != "auto":
        return requested
    arch = getattr(model.config, "model_type", None)
    if device_type(device) == "cuda" and arch in SUPPORTED_ARCHS and kernels.available(device):
        return IMPL_NAME
    return str(model.config._experts_implementation)
