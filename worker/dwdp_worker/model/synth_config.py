"""Tiny configs for any `transformers` architecture, built from the architecture's own config class.

``tiny_config(model_type)`` instantiates ``CONFIG_MAPPING[model_type]`` with every size field it declares
that ``TINY`` knows set small (hidden 64 = 4 heads x 16, 8 experts, top-2, expert FFN 32, vocab 256, a few
layers), so the config class's own ``__post_init__`` derives the rest (layer types, rope defaults) for that
size. Sub-configs (``text_config``, ``vision_config``, …) are shrunk the same way. Per-layer lists the class
ships with a fixed length (e.g. ``layer_types`` of the full model) are cut to the tiny layer count; special
token ids outside the tiny vocabulary are moved inside it (an embedding's ``padding_idx`` must be < vocab).

Which class serves text generation (``serving_auto_class``): ``AutoModelForCausalLM`` when `transformers` maps
the config to one, else ``AutoModelForImageTextToText`` / ``AutoModelForMultimodalLM`` (a vision-language
model serving text prompts: its vision tower is dense and replicated; only the text MoE is sharded).

Sizes are chosen for the CPU oracle: every expert tensor is a multiple of 64 bytes in float32 (bitwise
precondition, see oracle.py) and a forward of ~100 tokens takes milliseconds.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

#: the tiny layer count (enough for one dense + one MoE layer where an architecture has dense layers first)
TINY_LAYERS = 3
#: the tiny vocabulary (the oracle's prompts use token ids < 256)
TINY_VOCAB = 256
#: routed experts: 8 lets d=2 and d=3 use overlapping and uneven ranges
TINY_EXPERTS = 8

#: config field → tiny value; a field is set only where the config class declares it
TINY: dict[str, Any] = {
    # trunk
    "vocab_size": TINY_VOCAB, "unpadded_vocab_size": TINY_VOCAB, "hidden_size": 64, "num_hidden_layers": TINY_LAYERS, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64, "max_position_embeddings": 512,
    "tie_word_embeddings": False, "d_model": 64, "n_layers": TINY_LAYERS, "num_heads": 4,
    # experts
    "num_experts": TINY_EXPERTS, "num_local_experts": TINY_EXPERTS, "n_routed_experts": TINY_EXPERTS,
    "moe_num_experts": TINY_EXPERTS, "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2,
    "moe_topk": 2, "moe_intermediate_size": 32, "moe_hidden_size": 32, "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32, "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "dense_intermediate_size": 64, "n_shared_experts": 1,
    "num_shared_experts": 1, "moe_num_shared_experts": 1, "n_group": 2, "num_expert_group": 2, "topk_group": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "router_hidden_size": 16,
    # MLA (DeepSeek-style attention)
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "o_lora_rank": 16, "o_groups": 2,
    # sparse-attention indexers
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16, "index_block_size": 16,
    # linear attention / SSM
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_head_dim": 16, "linear_num_heads": 2, "mamba_n_heads": 4, "mamba_num_heads": 4, "mamba_head_dim": 16,
    "mamba_d_head": 16, "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8, "n_groups": 1,
    "mamba_chunk_size": 32, "chunk_size": 32,
    # windows and per-layer extras
    "sliding_window": 64, "sliding_window_size": 64, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "swa_head_dim": 16, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": TINY_VOCAB,
    "max_window_layers": TINY_LAYERS, "global_attn_every_n_layers": 2,
    # vision/audio towers built beside the text model (kept small; never run on text prompts)
    "depth": 1, "num_hidden_layers_vision": 1, "out_hidden_size": 64, "encoder_layers": 1, "projector_hidden_size": 64,
    "text_hidden_size": 64, "merged_hidden_size": 64, "projection_hidden_dim": 64, "projection_intermediate_size": 64,
    "encoder_attention_heads": 4, "encoder_ffn_dim": 64,
    # MoE blocks some architectures ship switched off in their default config
    "enable_moe_block": True, "top_k_experts": 2,
}

#: fields that MLA configs derive themselves (``head_dim = qk_rope_head_dim``): not set when MLA is declared
_MLA_DERIVED = ("head_dim",)

#: retried, one at a time, when a config class refuses the tiny sizes (its own validation says which)
FALLBACKS: tuple[dict[str, Any], ...] = ({"num_key_value_heads": 4}, {"num_experts_per_tok": 1})

#: special-token fields that index the embedding (moved inside the tiny vocabulary)
_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}


def _default_of(default, name: str):
    try:  # per-layer-config classes refuse global reads of per-layer fields
        return getattr(default, name, None)
    except Exception:  # noqa: BLE001
        return None


def _is_off(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value == 0


def _layer_selection(per_layer: dict[str, list], n: int) -> list[int]:
    """``n`` layer indices covering every distinct combination of per-layer values (first occurrences first),
    so the tiny model keeps e.g. one dense and one sparse MLP layer, one sliding and one full attention."""
    length = len(next(iter(per_layer.values())))
    kinds = [tuple(str(v[i]) for v in per_layer.values()) for i in range(length)]
    first = [kinds.index(k) for k in dict.fromkeys(kinds)]
    chosen = sorted(first[:n])
    for i in range(length):
        if len(chosen) >= n:
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen)


def _rescale_mrope(rope: Any, head_dim: int, partial: float) -> Any:
    """A multimodal rope's ``mrope_section`` (sums to the rotary dim / 2) rescaled to the tiny head_dim."""
    if not isinstance(rope, dict) or not isinstance(rope.get("mrope_section"), list):
        return rope
    sec = rope["mrope_section"]
    partial = float(rope.get("partial_rotary_factor", partial) or 1.0)
    half, total = int(head_dim * partial) // 2, sum(sec)
    new = [max(1, s * half // total) for s in sec]
    new[0] += half - sum(new)
    return {**rope, "mrope_section": new}


def _shrink(cls, *, tower: bool = False, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Constructor overrides making ``cls`` tiny (recursing into its sub-configs); ``overrides`` win."""
    names = _fields(cls)
    default = cls()
    n_default = _default_of(default, "num_hidden_layers")
    # a size the class ships as 0 means "off" (e.g. no RoPE part): it stays off
    out = {k: v for k, v in TINY.items() if k in names and not _is_off(_default_of(default, k))}
    h_default = _default_of(default, "hidden_size")
    if "hidden_size" in out and isinstance(h_default, int):  # widths tied to the hidden size follow it
        out.update({k: out["hidden_size"] for k in names - set(out) - {"hidden_size"}
                    if k.endswith(("_dim", "_size")) and _default_of(default, k) == h_default})
    if "qk_rope_head_dim" in names:
        for k in _MLA_DERIVED:
            out.pop(k, None)
    if "kv_lora_rank" in names and "num_attention_heads" in out:  # MLA: keys/values have every head
        out["num_key_value_heads"] = out["num_attention_heads"]
    if tower:  # vision/audio towers: one block, tiny width; never run on text prompts
        out.update({k: v for k, v in {"num_hidden_layers": 1, "depth": 1, "hidden_size": 64, "intermediate_size": 64,
                                      "num_attention_heads": 4, "num_heads": 4}.items() if k in names})
    for k, v in list(out.items()):  # a field the class declares as a list (e.g. per modality) stays a list
        dv = _default_of(default, k)
        if isinstance(dv, list) and not isinstance(v, list):
            out[k] = [v] * len(dv)
    for k, v in (overrides or {}).items():  # a dict for a sub-config refines that sub-config (below)
        if not isinstance(v, dict):
            out[k] = v
    if {"mamba_expand", "mamba_n_heads", "mamba_d_head"} <= names and "hidden_size" in out:
        out["mamba_d_head"] = int(_default_of(default, "mamba_expand") or 2) * out["hidden_size"] // out["mamba_n_heads"]
    n = out.get("num_hidden_layers", TINY_LAYERS)
    per_layer = {name: _default_of(default, name) for name in sorted(names) if name not in out}
    per_layer = {k: v for k, v in per_layer.items() if isinstance(v, list) and n_default and len(v) == n_default}
    if per_layer and n_default and n < n_default:
        keep = _layer_selection(per_layer, n)
        out.update({k: [v[i] for i in keep] for k, v in per_layer.items()})
    for name in _TOKEN_FIELDS:
        value = _default_of(default, name)
        if isinstance(value, int) and value >= TINY_VOCAB:
            out[name] = TINY_VOCAB - 1 - _TOKEN_FIELDS.index(name)
        elif isinstance(value, list) and any(isinstance(v, int) and v >= TINY_VOCAB for v in value):
            out[name] = [TINY_VOCAB - 1 - _TOKEN_FIELDS.index(name)]
    head_dim = out.get("head_dim") or (out["hidden_size"] // out["num_attention_heads"]
                                       if {"hidden_size", "num_attention_heads"} <= set(out) else None)
    if out.get("qk_rope_head_dim"):  # MLA: the rotary part is qk_rope_head_dim wide
        head_dim = out["qk_rope_head_dim"]
    for rope_field in ("rope_parameters", "rope_scaling"):
        if rope_field in names and head_dim:
            rope = _rescale_mrope(_default_of(default, rope_field), head_dim,
                                  _default_of(default, "partial_rotary_factor") or 1.0)
            if rope is not _default_of(default, rope_field):
                out[rope_field] = rope
    for name, sub in (getattr(default, "sub_configs", None) or {}).items():
        if name not in names:
            continue
        concrete = type(_default_of(default, name)) if _default_of(default, name) is not None else sub
        if not (isinstance(concrete, type) and hasattr(concrete, "model_type")) or concrete.__name__ == "AutoConfig":
            continue
        is_tower = any(w in name for w in ("vision", "audio", "visual", "image", "encoder", "talker"))
        sub_kwargs = _shrink(concrete, tower=is_tower, overrides=(overrides or {}).get(name))
        if sub is not concrete or concrete.__name__ == "AutoConfig" or getattr(sub, "__name__", "") == "AutoConfig":
            sub_kwargs["model_type"] = concrete.model_type
        out[name] = sub_kwargs
    return out


def _with_fallback(kwargs: dict, fallback: dict) -> dict:
    """``kwargs`` with ``fallback``'s fields replaced wherever they are set (sub-config dicts included)."""
    out = {k: _with_fallback(v, fallback) if isinstance(v, dict) else v for k, v in kwargs.items()}
    out.update({k: v for k, v in fallback.items() if k in kwargs})
    return out


def tiny_config(model_type: str, *, seed_overrides: dict[str, Any] | None = None):
    """A tiny config of ``model_type`` from its own config class (``ValueError`` if it refuses the sizes).

    ``seed_overrides``: constructor fields set after the tiny ones (e.g. larger sizes for a memory test)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        cls = CONFIG_MAPPING[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not known to this transformers") from None
    kwargs = _shrink(cls, overrides=seed_overrides)
    first_error = None
    for fallback in ({}, *FALLBACKS):
        try:
            return cls(**_with_fallback(kwargs, fallback))
        except Exception as exc:  # noqa: BLE001 - a config class validates in its own words
            first_error = first_error or exc
    msg = " ".join(str(first_error).split())[:300]
    raise ValueError(f"{model_type}: {cls.__name__} refuses a tiny configuration ({type(first_error).__name__}: {msg})")


def serving_auto_class(config):
    """The `transformers` Auto class that builds the text-generating model of ``config`` (or ValueError)."""
    import transformers

    for name in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModelForMultimodalLM"):
        auto = getattr(transformers, name, None)
        if auto is not None and type(config) in auto._model_mapping:
            return auto
    raise ValueError(f"{config.model_type}: transformers has no causal-LM or image-text-to-text model class for "
                     f"{type(config).__name__}")


__all__ = ["TINY", "TINY_EXPERTS", "TINY_LAYERS", "TINY_VOCAB", "serving_auto_class", "tiny_config"]
