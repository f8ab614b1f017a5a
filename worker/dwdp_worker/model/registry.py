"""Which models DWDP serves, decided from the model: any `transformers` MoE causal LM whose experts go through
`transformers`' experts interface (``@use_experts_implementation``: fused ``[E, …]`` parameters).

No table of architectures: ``experts_discovery.discover`` finds the experts modules and their layout
(``experts_layout.ModelLayout``), ``checkpoint_names`` derives the checkpoint keys of every tensor from the
weight-conversion rules `transformers` loads that architecture with. docs/MODELS.md has the generated
support matrix (``tests/worker/test_models_matrix.py``) and what is sharded vs replicated.

This module is the small facade the engine, loader and hooks use:
  * ``check_supported_config(config)`` — refusals that need only the config (quantized checkpoints);
  * ``model_layout(model)`` — the discovered layout, refusing a model without experts;
  * ``experts_sites(model)`` — (layer, path, module, layout) per experts module, forward order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .experts_discovery import UnsupportedModelError, discover
from .experts_layout import ExpertsLayout, ModelLayout

#: the architectures the GPU oracle (tests/gpu/test_oracle_gpu.py, H200) checks and ``synth`` has hand-sized
#: presets for. Not a gate on what is served (any discovered experts layout is); ``experts_impl``'s ``auto``
#: keeps the fused kernels on these until the GPU oracle covers more.
SUPPORTED_ARCHS: tuple[str, ...] = ("qwen3_moe", "mixtral", "deepseek_v3")


def check_supported_config(config: Any) -> None:
    """Refuse configs DWDP cannot shard faithfully before building anything: a quantization other than FP8
    block-scaled or FP4 (``dwdp_runtime.quant.parse_quantization_config`` names what is supported)."""
    from dwdp_runtime.quant import UnsupportedQuantizationError, parse_quantization_config

    model_type = getattr(config, "model_type", None)
    try:
        parse_quantization_config(getattr(config, "quantization_config", None))
    except UnsupportedQuantizationError as exc:
        raise UnsupportedModelError(f"{model_type}: {exc}") from None


def model_layout(model: Any) -> ModelLayout:
    """The experts layout of ``model``; ``UnsupportedModelError`` if it has no experts module."""
    layout = discover(model)
    if not layout.experts:
        raise UnsupportedModelError(
            f"model_type {layout.model_type!r} is not supported by DWDP: {type(model).__name__} has no experts "
            f"module under transformers' experts interface (@use_experts_implementation); DWDP shards MoE experts")
    return layout


#: config.json keys that usually hold the routed expert count: a quick answer where no model may be built (the
#: supervisor sizing the group); each rank checks it against the discovered layout (``Engine.build`` refuses a
#: DwdpConfig whose num_experts differs from what discovery finds)
EXPERT_COUNT_KEYS: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def expert_count_hint(raw_config: dict) -> int | None:
    """The expert count a raw config.json states (top level or ``text_config``), or None."""
    for d in (raw_config, raw_config.get("text_config") or {}):
        for key in EXPERT_COUNT_KEYS:
            value = d.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def num_experts_in_config(config: Any) -> int:
    """The routed expert count, read from the model `transformers` builds for ``config`` (on the meta device)."""
    import copy

    import torch

    from .meta_model import build_meta_model

    # a copy: from_config records the dtype it built with in the config (the caller's dtype must stay its own)
    return model_layout(build_meta_model(copy.deepcopy(config), torch.float32)).num_experts


@dataclass(frozen=True)
class ExpertsSite:
    layer: int              # decoder layer index (the DWDP layer key)
    name: str               # module path inside the model, e.g. "model.layers.1.mlp.experts"
    module: Any             # the experts nn.Module
    layout: ExpertsLayout


def experts_sites(model: Any, layout: ModelLayout | None = None) -> list[ExpertsSite]:
    """Every experts module of ``model`` in forward order (dense layers have none)."""
    layout = layout or discover(model)
    return [ExpertsSite(e.layer, e.path, model.get_submodule(e.path), e) for e in layout.experts]


__all__ = ["EXPERT_COUNT_KEYS", "SUPPORTED_ARCHS", "ExpertsSite", "expert_count_hint", "UnsupportedModelError", "check_supported_config", "experts_sites", "model_layout",
           "num_experts_in_config"]
