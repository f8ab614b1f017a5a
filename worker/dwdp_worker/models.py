"""Architecture registry: where a `transformers` MoE causal LM keeps its experts, and how its checkpoint names them.

Supported (``SUPPORTED_ARCHS``): ``qwen3_moe``, ``mixtral``, ``deepseek_v3``. All three use the fused 3-D
experts module of `transformers` >= 5 (``<Arch>Experts`` with ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]``, no biases, no per-expert scales).

Per-expert tensors and what DWDP does with them (see docs/MODELS.md):

  * ``experts.gate_up_proj``, ``experts.down_proj`` — **sharded**: rank r loads experts
    ``[r*s, min(r*s+k, N))`` into its transport handle; the model sees the composite ``[E, ...]`` tensor.
  * router ``gate.weight [E, H]`` and DeepSeek-V3's ``gate.e_score_correction_bias [E]`` — **replicated**:
    every rank routes every token over all E experts, so the router needs all rows; they are tiny (E·H).
  * DeepSeek-V3 ``shared_experts`` (a dense MLP every token passes) — **replicated**, like any dense weight.

Invariants:
  * ``ExpertsSite.layer`` is the decoder-layer index; sites are returned in forward order (ascending
    layer index), which is the order DWDP registers layers in.
  * Checkpoint keys: ``save_pretrained`` writes one tensor per (expert, projection) in the original
    layout (``...experts.{e}.gate_proj.weight`` / ``w1`` for Mixtral); a checkpoint that already holds
    the fused 3-D tensor (``...experts.gate_up_proj``) is read too. ``gate_up = cat([gate, up], dim=0)``
    per expert, exactly as `transformers`' own ``MergeModulelist + Concatenate`` converter does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHS: tuple[str, ...] = ("qwen3_moe", "mixtral", "deepseek_v3")

#: the fused expert parameters DWDP shards, in registration order
EXPERT_WEIGHTS: tuple[str, ...] = ("gate_up_proj", "down_proj")

#: config.json keys that may hold the routed expert count (the attribute or its serialised alias)
NUM_EXPERTS_KEYS: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    #: config attribute holding the routed expert count
    num_experts_attr: str
    #: (model-name fragment, checkpoint-name fragment) renames, applied model → checkpoint
    ckpt_renames: tuple[tuple[str, str], ...]
    #: per-expert checkpoint projection names: (gate, up, down)
    proj_names: tuple[str, str, str]
    #: replicated per-expert tensors outside the experts module (documentation + loader checks)
    replicated_per_expert: tuple[str, ...]


ARCHS: dict[str, ArchSpec] = {
    "qwen3_moe": ArchSpec("qwen3_moe", "num_experts", (), ("gate_proj", "up_proj", "down_proj"),
                          ("mlp.gate.weight",)),
    "mixtral": ArchSpec("mixtral", "num_local_experts", ((".mlp.", ".block_sparse_moe."),), ("w1", "w3", "w2"),
                        ("block_sparse_moe.gate.weight",)),
    "deepseek_v3": ArchSpec("deepseek_v3", "n_routed_experts", (), ("gate_proj", "up_proj", "down_proj"),
                            ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")),
}


class UnsupportedModelError(ValueError):
    """The checkpoint is not one of the MoE architectures DWDP knows how to shard."""


def arch_spec(model_type: str) -> ArchSpec:
    try:
        return ARCHS[model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by DWDP; supported: {', '.join(SUPPORTED_ARCHS)}") from None


def num_experts_in_config(config: Any) -> int:
    spec = arch_spec(getattr(config, "model_type", None))
    n = getattr(config, spec.num_experts_attr, None)
    if not n:
        raise UnsupportedModelError(f"{spec.model_type} config has no {spec.num_experts_attr}: not a MoE checkpoint")
    return int(n)


def check_supported_config(config: Any) -> ArchSpec:
    """Refuse configs DWDP cannot shard faithfully (quantized experts carry per-expert scales)."""
    spec = arch_spec(getattr(config, "model_type", None))
    if getattr(config, "quantization_config", None):
        raise UnsupportedModelError(
            f"{spec.model_type}: quantized checkpoints (quantization_config={config.quantization_config!r}) carry "
            f"per-expert scale tensors that DWDP does not shard yet; use a bf16/fp16/fp32 checkpoint")
    num_experts_in_config(config)
    return spec


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertsSite:
    layer: int          # decoder layer index (the DWDP layer key)
    name: str           # module path inside the model, e.g. "model.layers.1.mlp.experts"
    module: Any         # the fused experts nn.Module


def experts_sites(model: Any) -> list[ExpertsSite]:
    """Every fused experts module of ``model`` in forward order (dense layers have none)."""
    sites = []
    for name, module in model.named_modules():
        params = getattr(module, "_parameters", {})
        if all(w in params and params[w] is not None and params[w].dim() == 3 for w in EXPERT_WEIGHTS):
            m = _LAYER.search(name + ".")
            if m is None:
                raise UnsupportedModelError(f"experts module {name!r} is not inside a decoder layer")
            sites.append(ExpertsSite(int(m.group(1)), name, module))
    sites.sort(key=lambda s: s.layer)
    if len({s.layer for s in sites}) != len(sites):
        raise UnsupportedModelError("more than one experts module per decoder layer is not supported")
    return sites


def is_expert_param(name: str) -> bool:
    """True for the sharded fused expert parameters (model naming)."""
    return any(name.endswith(f".experts.{w}") for w in EXPERT_WEIGHTS)


def to_ckpt_name(spec: ArchSpec, model_name: str) -> str:
    out = model_name
    for frm, to in spec.ckpt_renames:
        out = out.replace(frm, to)
    return out


def expert_ckpt_keys(spec: ArchSpec, site_name: str, weight: str, expert: int) -> list[str]:
    """Per-expert checkpoint keys whose concatenation (dim 0) is ``weight[expert]``."""
    base = to_ckpt_name(spec, site_name)
    gate, up, down = spec.proj_names
    if weight == "gate_up_proj":
        return [f"{base}.{expert}.{gate}.weight", f"{base}.{expert}.{up}.weight"]
    if weight == "down_proj":
        return [f"{base}.{expert}.{down}.weight"]
    raise KeyError(weight)


def fused_ckpt_key(spec: ArchSpec, site_name: str, weight: str) -> str:
    """The key of a checkpoint that stores the fused 3-D tensor directly."""
    return f"{site_name}.{weight}"
