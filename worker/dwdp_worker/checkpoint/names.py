"""Checkpoint names from `transformers`' own loading rules: which checkpoint keys make up each model tensor.

``CheckpointMap.build(model, keys)`` runs every checkpoint key through the same renaming `from_pretrained`
applies (``conversion_mapping.get_model_conversion_mapping`` + ``core_model_loading.rename_source_key``:
the architecture's ``WeightRenaming``s, then at most one ``WeightConverter``, then the base-model-prefix
fix-up), and groups the keys by the model tensor they load into. No architecture is named here: a new
architecture's rules arrive with the `transformers` release that adds it.

Experts (``resolve_sources``) — the converter's operations are interpreted, not executed, so that a rank
can read only its own experts' bytes:

  * ``MergeModulelist(dim=0)`` over per-expert keys → PER_EXPERT: the i-th key in `transformers`' natural
    key order (``dot_natural_key``) is expert i, exactly the position ``torch.stack`` gives it;
  * followed by ``Concatenate(dim=d)``, d ≥ 1 → the parts (e.g. gate then up, in source-pattern order) are
    concatenated along per-expert dim d − 1 (``gate_up_proj[e] = cat([gate_e, up_e], 0)``);
  * a plain rename, or no rule at all, onto the fused name → FUSED: experts [a, b) are rows [a, b);
  * ``Transpose(dim0, dim1)`` / ``Interleave(dim)`` of a fused tensor on dims ≥ 1 → FUSED with those ops run
    by `transformers` on each expert's slice (``check_dims`` decided once, as `transformers` does, on the
    whole tensor's shape);
  * anything else (interleaving, text/vision expert splits, dequantizing converters) is refused with an
    ``UnsupportedModelError`` that names the tensor and the operation.

Dense tensors (``dense_sources``): a renamed key is read whole; a converter (e.g. a fused qkv split) is
executed by `transformers` itself on the full source tensors (they are replicated anyway).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..model.experts_discovery import UnsupportedModelError
from ..model.experts_layout import CheckpointSource, ExpertsLayout, ModelLayout, SourceKind
from .safetensors_index import CheckpointError


@dataclass(frozen=True)
class KeyMatch:
    key: str                  # checkpoint key
    pattern: str | None       # the converter's source pattern that matched (None: a plain rename or identity)
    converter: Any = None     # the WeightConverter (None: plain rename)


def conversion_rules(model: Any) -> tuple[list, list]:
    """(renamings, converters) `from_pretrained` uses for ``model`` (empty on a `transformers` without them)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    rules = get_model_conversion_mapping(model) or []
    return ([r for r in rules if isinstance(r, WeightRenaming)], [r for r in rules if isinstance(r, WeightConverter)])


def _natural(key: str):
    try:
        from transformers.core_model_loading import dot_natural_key
    except ImportError:  # same order for the keys that matter (digits numerically)
        return [(0, int(p)) if p.isdigit() else (1, p) for p in key.split(".")]
    return dot_natural_key(key)


class CheckpointMap:
    """model tensor name → the checkpoint keys that load into it, by `transformers`' rules."""

    def __init__(self, by_target: dict[str, list[KeyMatch]]):
        self.by_target = by_target

    @classmethod
    def build(cls, model: Any, keys: Iterable[str]) -> "CheckpointMap":
        renamings, converters = conversion_rules(model)
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        meta = model.state_dict()
        prefix = getattr(model, "base_model_prefix", None)
        try:
            from transformers.core_model_loading import rename_source_key
        except ImportError:
            rename_source_key = None
        by_target: dict[str, list[KeyMatch]] = defaultdict(list)
        for key in sorted(keys, key=_natural):
            if rename_source_key is None:
                target, pattern = key, None
            else:
                target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
                if target not in meta and key in meta:
                    target, pattern = rename_source_key(key, [], [], prefix, meta)
            if target in meta:
                by_target[target].append(KeyMatch(key, pattern, by_pattern.get(pattern)))
        return cls(dict(by_target))

    def matches(self, name: str) -> list[KeyMatch]:
        return self.by_target.get(name, [])


# -- experts ---------------------------------------------------------------------------------------------
def _expert_source(full: str, num_experts: int, expert_shape: tuple[int, ...], matches: list[KeyMatch],
                   shape_of: Callable[[str], tuple[int, ...]]) -> CheckpointSource:
    from transformers.core_model_loading import Concatenate, MergeModulelist

    if not matches:
        raise CheckpointError(f"checkpoint has no tensor for {full} (neither per-expert keys nor a fused tensor)")
    fused = [m for m in matches if m.converter is None]
    if fused:  # a plain rename onto the fused name (or the fused name itself) wins: it is one byte range
        key = fused[0].key
        _check_shape(full, key, shape_of(key), (num_experts, *expert_shape))
        return CheckpointSource(SourceKind.FUSED, ((key,),))
    conv = matches[0].converter
    per_expert, concat_dim, slice_ops = False, 0, []
    for op in conv.operations:
        if isinstance(op, MergeModulelist) and op.dim == 0 and not per_expert and not slice_ops:
            per_expert = True
        elif isinstance(op, Concatenate) and per_expert and op.dim >= 1:
            concat_dim = op.dim - 1
        elif not per_expert and _acts_within_experts(op):
            slice_ops.append(op)
        else:
            raise UnsupportedModelError(
                f"{full}: its checkpoint conversion uses {type(op).__name__} (rule {conv.source_patterns[0]!r} -> "
                f"{conv.target_patterns[0]!r}), which needs every expert at once; DWDP reads only a rank's own "
                f"experts and interprets MergeModulelist(dim=0), Concatenate(dim>=1), Transpose/Interleave of "
                f"per-expert dims")
    groups: dict[str, list[str]] = {p: [] for p in conv.source_patterns}
    for m in matches:
        groups.setdefault(m.pattern, []).append(m.key)
    parts = tuple(tuple(keys) for keys in groups.values() if keys)
    if not per_expert:
        if len(parts) != 1 or len(parts[0]) != 1:
            raise UnsupportedModelError(f"{full}: conversion {conv.source_patterns} combines several whole tensors")
        key = parts[0][0]
        ops = _resolve_check_dims(slice_ops, tuple(shape_of(key)), (num_experts, *expert_shape))
        _check_shape(full, key, _sliced_shape(tuple(shape_of(key)), ops), (1, *expert_shape))
        return CheckpointSource(SourceKind.FUSED, ((key,),), slice_ops=ops)
    if len(parts) > 1 and not any(isinstance(op, Concatenate) for op in conv.operations):
        raise UnsupportedModelError(f"{full}: conversion {conv.source_patterns} merges several parts without Concatenate")
    for keys in parts:
        if len(keys) != num_experts:
            raise CheckpointError(f"{full}: checkpoint has {len(keys)} per-expert tensors like {keys[0]}, "
                                  f"the model has {num_experts} experts")
    _check_parts(full, parts, expert_shape, concat_dim, shape_of)
    return CheckpointSource(SourceKind.PER_EXPERT, parts, concat_dim=concat_dim)


def _acts_within_experts(op) -> bool:
    """A single-tensor op that moves data only inside each expert's slice (dims >= 1), so it can run per expert."""
    from transformers.core_model_loading import Interleave, Transpose

    if isinstance(op, Transpose):
        return min(op.dim0, op.dim1) >= 1
    if isinstance(op, Interleave):
        return op.dim >= 1
    return False


def _resolve_check_dims(ops, stored: tuple[int, ...], model_shape: tuple[int, ...]) -> tuple:
    """``Transpose(check_dims=True)`` transposes only a tensor whose shape differs from the model's (transformers'
    rule, decided on the whole tensor): decided here once, so the per-expert ops are unconditional."""
    from transformers.core_model_loading import Transpose

    out = []
    for op in ops:
        if isinstance(op, Transpose) and getattr(op, "check_dims", False):
            if stored == model_shape:
                continue
            op = Transpose(dim0=op.dim0, dim1=op.dim1)
        out.append(op)
    return tuple(out)


def apply_slice_ops(ops, tensor):
    """``tensor`` (one expert's slice, ``[1, ...]``) through `transformers`' conversion ops, in order."""
    for op in ops:
        tensor = next(iter(op.convert({"slice": tensor}, source_patterns=["slice"], target_patterns=["slice"]).values()))
    return tensor


def _sliced_shape(stored: tuple[int, ...], ops) -> tuple[int, ...]:
    import torch

    return tuple(apply_slice_ops(ops, torch.empty((1, *stored[1:]), device="meta")).shape)


def _check_shape(full: str, key: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"{key}: checkpoint shape {tuple(got)} != {want} expected for {full} "
                              f"(config.json does not match the weights)")


def _check_parts(full, parts, expert_shape, dim, shape_of) -> None:
    for e in range(len(parts[0])):
        shapes = [tuple(shape_of(p[e])) for p in parts]
        rest = {s[:dim] + s[dim + 1:] for s in shapes}
        total = sum(s[dim] for s in shapes if len(s) > dim)
        want_rest = expert_shape[:dim] + expert_shape[dim + 1:]
        if any(len(s) != len(expert_shape) for s in shapes) or rest != {want_rest} or total != expert_shape[dim]:
            raise CheckpointError(f"{full} expert {e}: checkpoint parts {[p[e] for p in parts]} have shapes {shapes}, "
                                  f"which do not concatenate (dim {dim}) to {expert_shape}")


def resolve_sources(layout: ModelLayout, cmap: CheckpointMap,
                    shape_of: Callable[[str], tuple[int, ...]]) -> ModelLayout:
    """``layout`` with every sharded parameter's ``CheckpointSource`` filled in (errors name the tensor)."""
    def one(e: ExpertsLayout) -> ExpertsLayout:
        return e.with_sources({p.name: _expert_source(e.full_name(p.name), e.num_experts, p.expert_shape,
                                                      cmap.matches(e.full_name(p.name)), shape_of)
                               for p in e.params})

    return layout.replace_experts(one(e) for e in layout.experts)


# -- dense tensors -----------------------------------------------------------------------------------------
def dense_tensors(model: Any, name: str, cmap: CheckpointMap, read: Callable[[str], Any]) -> dict[str, Any]:
    """The model tensors that loading ``name``'s checkpoint keys produces (``{}``: not in the checkpoint).

    A plain rename gives ``{name: tensor}``; a converter is executed by `transformers` and may produce
    several model tensors at once (e.g. q, k, v from one fused qkv)."""
    import copy

    matches = cmap.matches(name)
    if not matches:
        return {}
    plain = [m for m in matches if m.converter is None]
    if plain:
        return {name: read(plain[0].key)}
    conv = copy.deepcopy(matches[0].converter)
    for m in matches:
        conv.add_tensor(name, m.key, m.pattern, read(m.key))
    try:
        return dict(conv.convert(name, model=model, config=getattr(model, "config", None)))
    except Exception as exc:  # noqa: BLE001 - transformers' ops raise anything; the message names the tensor
        raise CheckpointError(f"{name}: transformers' conversion {conv.source_patterns} failed: {exc}") from None


__all__ = ["CheckpointError", "CheckpointMap", "KeyMatch", "apply_slice_ops", "conversion_rules", "dense_tensors", "resolve_sources"]
