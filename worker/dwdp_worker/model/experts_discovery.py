"""Find the experts modules of a `transformers` model and describe them (``ModelLayout``), from the model itself.

An experts module is an instance of a class decorated with ``transformers.integrations.moe.
use_experts_implementation`` (the experts interface, `transformers` ≥ 5): the decorator replaces the class's
``forward`` with one shared dispatch function and sets ``has_gate``, ``has_bias``, ``is_transposed``,
``is_concatenated`` on each instance. Recognising the dispatch function by its code object identifies every
such class — of any architecture, present or future — without a table of names.

Sharded: every direct parameter of the experts module whose leading dimension is ``num_experts`` (weights
``[E, …]`` and biases ``[E, out]``). Replicated: everything else, listed per module for the MoE block the
experts sit in (router, score-correction bias, shared experts, post-expert norms).

Refused (``UnsupportedModelError`` naming the module): an experts module outside a decoder layer
(``….layers.N.…``), several experts modules in one decoder layer (DWDP's prefetch schedule runs one experts
module per layer, in order: a second module — e.g. a vision-token MoE beside the text MoE — may or may not
run depending on the prompt, so the schedule could not be static), an experts module with no ``[E, …]``
parameter, and experts modules that disagree on the expert count.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from .experts_layout import ExpertParam, ExpertsLayout, ModelLayout, ParamRole


class UnsupportedModelError(ValueError):
    """The model is not one DWDP can shard faithfully; the message says which module and why."""


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@functools.lru_cache(maxsize=1)
def _dispatch_code():
    """The code object of the experts interface's dispatching ``forward`` (None: no experts interface)."""
    try:
        import torch
        from transformers.integrations.moe import use_experts_implementation
    except ImportError:
        return None

    class _Probe(torch.nn.Module):
        def __init__(self, config):
            super().__init__()

        def forward(self, x):
            return x

    return use_experts_implementation(_Probe).forward.__code__


def is_experts_module(module: Any) -> bool:
    """True for an instance of a class under `transformers`' experts interface."""
    code = _dispatch_code()
    fwd = getattr(type(module), "forward", None)
    return code is not None and getattr(fwd, "__code__", None) is code and hasattr(module, "has_gate")


def _describe(path: str, module: Any, model: Any) -> ExpertsLayout:
    params = dict(module.named_parameters(recurse=False))
    num = getattr(module, "num_experts", None)
    if not isinstance(num, int) or num < 1:
        three_d = [p for p in params.values() if p.dim() == 3]
        num = int(three_d[0].shape[0]) if three_d else 0
    sharded = tuple(ExpertParam(name, ParamRole.of(name), tuple(int(d) for d in p.shape[1:]), p.dtype)
                    for name, p in params.items() if p.dim() >= 2 and int(p.shape[0]) == num)
    if not sharded:
        raise UnsupportedModelError(f"experts module {path!r} ({type(module).__name__}) has no per-expert [E, ...] "
                                    f"parameter to shard (parameters: {sorted(params)})")
    m = _LAYER.search(path + ".")
    if m is None:
        raise UnsupportedModelError(f"experts module {path!r} ({type(module).__name__}) is not inside a decoder "
                                    f"layer (…layers.N…): DWDP keys its prefetch schedule by decoder layer")
    block = path.rpartition(".")[0]
    shard_names = {f"{path}.{p.name}" for p in sharded}
    replicated = tuple(n for n, _ in _block_tensors(model, block) if n not in shard_names)
    return ExpertsLayout(path=path, layer=int(m.group(1)), num_experts=num,
                         is_transposed=bool(getattr(module, "is_transposed", False)),
                         has_gate=bool(getattr(module, "has_gate", True)),
                         has_bias=bool(getattr(module, "has_bias", False)),
                         is_concatenated=bool(getattr(module, "is_concatenated", True)),
                         params=sharded, replicated=replicated, class_name=type(module).__name__)


def _block_tensors(model: Any, block: str):
    mod = model.get_submodule(block) if block else model
    prefix = f"{block}." if block else ""
    yield from ((prefix + n, t) for n, t in mod.named_parameters())
    yield from ((prefix + n, t) for n, t in mod.named_buffers())


def experts_modules(model: Any) -> list[tuple[str, Any]]:
    """(path, module) of every experts module of ``model``, in module-registration order."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


def discover(model: Any) -> ModelLayout:
    """The ``ModelLayout`` of ``model`` (sorted by decoder layer); refuses what DWDP cannot shard."""
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or type(model).__name__)
    found = [_describe(path, m, model) for path, m in experts_modules(model)]
    found.sort(key=lambda e: e.layer)
    by_layer: dict[int, list[str]] = {}
    for e in found:
        by_layer.setdefault(e.layer, []).append(e.path)
    several = {layer: paths for layer, paths in by_layer.items() if len(paths) > 1}
    if several:
        layer, paths = next(iter(several.items()))
        raise UnsupportedModelError(
            f"{model_type}: decoder layer {layer} has {len(paths)} experts modules ({', '.join(paths)}); DWDP runs "
            f"one experts module per layer (which of several runs depends on the tokens, so its prefetch schedule "
            f"could not be fixed)")
    layout = ModelLayout(model_type, tuple(found))
    if found and len({e.num_experts for e in found}) > 1:
        raise UnsupportedModelError(f"{model_type}: experts modules disagree on the expert count "
                                    f"({sorted({e.num_experts for e in found})}); DWDP shards one expert range")
    return layout


__all__ = ["UnsupportedModelError", "discover", "experts_modules", "is_experts_module"]
