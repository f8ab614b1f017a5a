"""Read the shape of a MoE model from a Hugging Face ``config.json`` (or a built-in preset).

Pure Python. One parser for every source: presets in ``presets.MODELS`` are config.json dicts.

Fields understood (first match wins):
  hidden_size; num_hidden_layers; vocab_size; tie_word_embeddings
  experts:        n_routed_experts | num_experts | num_local_experts
  top-k:          num_experts_per_tok
  expert FFN:     moe_intermediate_size, else intermediate_size (Mixtral)
  dense FFN:      intermediate_size
  shared experts: n_shared_experts × moe_intermediate_size (DeepSeek) | shared_expert_intermediate_size
  MoE layers:     DeepSeek  i >= first_k_dense_replace and i % moe_layer_freq == 0
                  Qwen-MoE  i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
                  otherwise every layer
  attention:      MLA when kv_lora_rank is present (q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                  qk_rope_head_dim, v_head_dim); else GQA with num_attention_heads,
                  num_key_value_heads (default = heads), head_dim (default hidden/heads).

Invariants: every count is a positive int; ``moe_layers`` is a sorted tuple of layer indices;
a model without routed experts is refused (the planner is for MoE models).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from . import presets


class ModelConfigError(ValueError):
    """A config.json that cannot be read or is missing a field the planner needs."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    name: str
    hidden: int
    num_layers: int
    moe_layers: tuple[int, ...]
    vocab: int
    tie_embeddings: bool
    num_experts: int
    top_k: int
    moe_inter: int
    dense_inter: int
    shared_inter: int          # total intermediate width of shared experts (0 = none)
    num_heads: int
    num_kv_heads: int
    head_dim: int              # GQA head dim (QK and V); for MLA: unused
    # MLA (DeepSeek); kv_lora_rank == 0 means GQA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def qk_dim(self) -> int:
        """Per-head dimension of Q·Kᵀ."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    # ---- parameter counts (elements) --------------------------------------------------------
    @property
    def expert_params(self) -> int:
        """One routed expert: gate+up (2·I·H) and down (H·I) = 3·H·I."""
        return 3 * self.hidden * self.moe_inter

    def attention_linear_dims(self) -> list[tuple[int, int]]:
        """(in, out) of every attention projection of one layer."""
        h, nh = self.hidden, self.num_heads
        if self.is_mla:
            qk = self.qk_dim
            dims = []
            if self.q_lora_rank:
                dims += [(h, self.q_lora_rank), (self.q_lora_rank, nh * qk)]
            else:
                dims += [(h, nh * qk)]
            dims += [(h, self.kv_lora_rank + self.qk_rope_head_dim),
                     (self.kv_lora_rank, nh * (self.qk_nope_head_dim + self.v_head_dim)),
                     (nh * self.v_head_dim, h)]
            return dims
        hd = self.head_dim
        return [(h, nh * hd), (h, self.num_kv_heads * hd), (h, self.num_kv_heads * hd), (nh * hd, h)]

    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers, bf16 (MLA caches the latent + rope key)."""
        per_layer = (self.kv_lora_rank + self.qk_rope_head_dim) if self.is_mla else 2 * self.num_kv_heads * self.head_dim
        return per_layer * self.num_layers * presets.ACT_BYTES


def _get(cfg: dict, *keys, default=None, required: bool = True, src: str = ""):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    if default is not None or not required:
        return default
    raise ModelConfigError(f"{src or 'config'}: missing {' / '.join(keys)}")


def from_hf_config(cfg: dict, *, name: str | None = None, src: str = "") -> ModelShape:
    """Build a :class:`ModelShape` from a config.json dict (see the module docstring)."""
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{src or 'config'}: expected a JSON object")
    if "text_config" in cfg and "hidden_size" not in cfg:  # multimodal wrappers
        cfg = cfg["text_config"]
    try:
        hidden = int(_get(cfg, "hidden_size", src=src))
        layers = int(_get(cfg, "num_hidden_layers", src=src))
        n_exp = int(_get(cfg, "n_routed_experts", "num_experts", "num_local_experts", default=0, src=src))
        if n_exp < 1:
            raise ModelConfigError(f"{src or 'config'}: no routed experts (n_routed_experts / num_experts / "
                                   f"num_local_experts): the planner models MoE models only")
        top_k = int(_get(cfg, "num_experts_per_tok", src=src))
        dense_inter = int(_get(cfg, "intermediate_size", default=0, required=False))
        moe_inter = int(_get(cfg, "moe_intermediate_size", default=dense_inter))
        if moe_inter < 1:
            raise ModelConfigError(f"{src or 'config'}: missing moe_intermediate_size / intermediate_size")
        heads = int(_get(cfg, "num_attention_heads", src=src))
        kv_heads = int(_get(cfg, "num_key_value_heads", default=heads))
        head_dim = int(_get(cfg, "head_dim", default=hidden // heads))
        vocab = int(_get(cfg, "vocab_size", src=src))
        if "first_k_dense_replace" in cfg or "n_routed_experts" in cfg:
            k_dense = int(cfg.get("first_k_dense_replace") or 0)
            freq = int(cfg.get("moe_layer_freq") or 1)
            moe_layers = tuple(i for i in range(layers) if i >= k_dense and i % freq == 0)
        elif "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:
            step = int(cfg.get("decoder_sparse_step") or 1)
            only = set(cfg.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
        else:
            moe_layers = tuple(range(layers))
        shared = int(cfg.get("n_shared_experts") or 0) * moe_inter + int(cfg.get("shared_expert_intermediate_size") or 0)
        mla = {}
        if cfg.get("kv_lora_rank"):
            mla = dict(
                q_lora_rank=int(cfg.get("q_lora_rank") or 0), kv_lora_rank=int(cfg["kv_lora_rank"]),
                qk_nope_head_dim=int(_get(cfg, "qk_nope_head_dim", src=src)),
                qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim", src=src)),
                v_head_dim=int(_get(cfg, "v_head_dim", src=src)))
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelConfigError):
            raise
        raise ModelConfigError(f"{src or 'config'}: bad field value ({e})") from None
    values = dict(hidden=hidden, num_layers=layers, num_experts=n_exp, top_k=top_k, moe_inter=moe_inter,
                  num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab=vocab)
    bad = [k for k, v in values.items() if v < 1]
    if bad:
        raise ModelConfigError(f"{src or 'config'}: fields must be >= 1: {', '.join(bad)}")
    if top_k > n_exp:
        raise ModelConfigError(f"{src or 'config'}: num_experts_per_tok={top_k} > experts={n_exp}")
    if dense_inter < 1 and len(moe_layers) < layers:
        raise ModelConfigError(f"{src or 'config'}: dense layers present but intermediate_size missing")
    return ModelShape(
        name=name or cfg.get("_name") or cfg.get("_name_or_path") or cfg.get("model_type") or "model",
        hidden=hidden, num_layers=layers, moe_layers=moe_layers, vocab=vocab,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), num_experts=n_exp, top_k=top_k,
        moe_inter=moe_inter, dense_inter=max(dense_inter, 0), shared_inter=shared, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, **mla)


def load_model(spec: str | dict | ModelShape) -> ModelShape:
    """A preset name (``deepseek-r1``…), a path to a config.json (or its folder), a dict, or a shape."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, dict):
        return from_hf_config(spec)
    key = presets.MODEL_ALIASES.get(spec.strip().lower())
    if key is not None:
        return from_hf_config(presets.MODELS[key], src=f"preset {key}")
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.exists(path):
        raise ModelConfigError(
            f"model {spec!r} is neither a preset ({', '.join(sorted(presets.MODELS))}) nor an existing "
            f"config.json path")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelConfigError(f"{path}: cannot read JSON ({e})") from None
    return from_hf_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(path))), src=path)
