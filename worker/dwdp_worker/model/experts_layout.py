"""The discovered experts layout: what DWDP shards in a `transformers` MoE model, and where its bytes live.

This is the one description the loader, the hooks, the fused experts kernels (``experts_impl``) and the
quantized-experts path (``dwdp_runtime.quant``) read. It is produced by ``experts_discovery.discover``
from the model itself (never from a table) and completed with checkpoint sources by
``checkpoint_names.resolve_sources`` from `transformers`' own weight-conversion rules.

    ModelLayout
      └─ ExpertsLayout   one per experts module (a class under `transformers`' experts interface)
           ├─ path, layer, num_experts, is_transposed, has_gate, has_bias, is_concatenated
           ├─ params: ExpertParam*   the **sharded** per-expert tensors, registration order
           │     name, role (weight | bias | scale), expert_shape (shape of param[e]), dtype,
           │     source: CheckpointSource (which checkpoint keys make up param[e])
           └─ replicated: model names of the MoE block's other tensors (router, shared experts, …)

Invariants:
  * every sharded parameter is a direct parameter of the experts module whose leading dimension is
    ``num_experts``; ``param[e]`` has ``expert_shape`` and DWDP moves it as one contiguous byte range;
  * biases (``*_bias``, ``[E, out]``) are per-expert tensors and sharded exactly like the weights;
  * per-quantization extra tensors (FP8 ``*_scale_inv``, NVFP4 block scales) are more ``ExpertParam``s
    with ``role=SCALE`` (``ExpertsLayout.with_params``): the loader, transport and hooks handle any
    ``[E, ...]`` tensor the same way, so a quantization method adds declarations, not code paths;
  * ``replicated`` tensors are loaded whole on every rank: every rank routes every token over all
    ``num_experts`` experts (router rows are E·H, tiny) and shared experts are dense MLPs every token uses;
  * ``layer`` is the DWDP layer key (decoder-layer index); ``ModelLayout.experts`` is in forward order.

This module imports neither torch nor transformers: it is plain data plus pure helpers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator


class ParamRole(str, Enum):
    """What a sharded per-expert tensor is (kernels and quantization dispatch on it)."""

    WEIGHT = "weight"   # a projection matrix [E, out, in] (or [E, in, out] when is_transposed)
    BIAS = "bias"       # a per-expert bias [E, out]
    SCALE = "scale"     # a per-expert quantization tensor (e.g. FP8 weight_scale_inv per 128x128 block)

    @classmethod
    def of(cls, name: str) -> "ParamRole":
        """The role `transformers`' naming implies: ``*_bias`` → BIAS, ``*scale*`` → SCALE, else WEIGHT."""
        if name.endswith("_bias") or name == "bias":
            return cls.BIAS
        if "scale" in name:
            return cls.SCALE
        return cls.WEIGHT


class SourceKind(str, Enum):
    PER_EXPERT = "per_expert"   # one checkpoint tensor per (expert, part): save_pretrained's MergeModulelist layout
    FUSED = "fused"             # one [E, ...] checkpoint tensor: experts [a, b) are rows [a, b) (one byte range)


@dataclass(frozen=True)
class CheckpointSource:
    """Which checkpoint tensors make up ``param[e]`` and how.

    PER_EXPERT: ``param[e] = cat([parts[j][e] for j], dim=concat_dim)`` — ``parts[j]`` lists one key per
    expert (index = expert id, in `transformers`' natural key order), e.g. gate and up for ``gate_up_proj``.
    FUSED: ``param[e] = tensor[e]`` of the single key ``parts[0][0]``; when the checkpoint stores another
    layout, ``slice_ops`` (`transformers`' own conversion ops that act on dims >= 1 only, e.g.
    ``Transpose(1, 2)``, ``Interleave(dim=1)``) are applied to each expert's slice ``tensor[e:e+1]`` in order.
    """

    kind: SourceKind
    parts: tuple[tuple[str, ...], ...]
    concat_dim: int = 0
    slice_ops: tuple[Any, ...] = ()

    def keys(self, expert: int) -> list[str]:
        """The checkpoint keys read for expert ``expert`` (FUSED: the fused tensor's key)."""
        if self.kind is SourceKind.FUSED:
            return [self.parts[0][0]]
        return [part[expert] for part in self.parts]

    @property
    def fused_key(self) -> str | None:
        return self.parts[0][0] if self.kind is SourceKind.FUSED else None


@dataclass(frozen=True)
class ExpertParam:
    """One sharded per-expert tensor of an experts module."""

    name: str                       # attribute on the experts module, e.g. "gate_up_proj", "down_proj_bias"
    role: ParamRole
    expert_shape: tuple[int, ...]   # shape of param[e]
    dtype: Any                      # torch.dtype of the model parameter (before from_pretrained's fp32 overrides)
    source: CheckpointSource | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.expert_shape:
            n *= int(d)
        return n


@dataclass(frozen=True)
class ExpertsLayout:
    """One experts module: a `transformers` class under the experts interface (``@use_experts_implementation``)."""

    path: str                       # module path in the model, e.g. "model.layers.1.mlp.experts"
    layer: int                      # DWDP layer key: the decoder-layer index
    num_experts: int
    is_transposed: bool             # weights stored [E, in, out] instead of [E, out, in]
    has_gate: bool                  # gate_up_proj (gated) vs up_proj only
    has_bias: bool                  # per-expert biases present (sharded like the weights)
    is_concatenated: bool           # gate_up rows [gate; up] (True) or interleaved gate0, up0, … (False)
    params: tuple[ExpertParam, ...]  # sharded tensors in registration order
    replicated: tuple[str, ...] = ()  # model names of the MoE block's replicated tensors (router, shared experts)
    class_name: str = ""            # the experts class, for messages and the support matrix

    def param(self, name: str) -> ExpertParam:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"{self.path} has no sharded parameter {name!r} (has {[p.name for p in self.params]})")

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    def full_name(self, param: str) -> str:
        return f"{self.path}.{param}"

    def with_params(self, *extra: ExpertParam) -> "ExpertsLayout":
        """This layout with more sharded tensors (e.g. a quantization method's per-expert scales)."""
        clash = set(self.param_names) & {p.name for p in extra}
        if clash:
            raise ValueError(f"{self.path}: parameters {sorted(clash)} already declared")
        return dataclasses.replace(self, params=self.params + tuple(extra))

    def with_sources(self, sources: dict[str, CheckpointSource]) -> "ExpertsLayout":
        return dataclasses.replace(self, params=tuple(
            dataclasses.replace(p, source=sources.get(p.name, p.source)) for p in self.params))


@dataclass(frozen=True)
class ModelLayout:
    """Every experts module of a model, in forward order."""

    model_type: str
    experts: tuple[ExpertsLayout, ...]
    _sharded: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_sharded", frozenset(e.full_name(p.name) for e in self.experts for p in e.params))

    def __iter__(self) -> Iterator[ExpertsLayout]:
        return iter(self.experts)

    def __len__(self) -> int:
        return len(self.experts)

    @property
    def num_experts(self) -> int:
        counts = {e.num_experts for e in self.experts}
        if len(counts) != 1:
            raise ValueError(f"{self.model_type}: experts modules disagree on the expert count: {sorted(counts)}")
        return counts.pop()

    @property
    def layers(self) -> list[int]:
        return [e.layer for e in self.experts]

    def is_sharded(self, name: str) -> bool:
        """True for a model parameter name DWDP shards (never loaded whole by a rank)."""
        return name in self._sharded

    def replace_experts(self, experts) -> "ModelLayout":
        return ModelLayout(self.model_type, tuple(experts))


__all__ = ["CheckpointSource", "ExpertParam", "ExpertsLayout", "ModelLayout", "ParamRole", "SourceKind"]
