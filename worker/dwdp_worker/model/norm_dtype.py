"""Float32-kept RMSNorms that hand float32 to a 16-bit model: give them the cast back that later `transformers` has.

Why: a model may keep some norms in float32 inside a bf16 model (``_keep_in_fp32_modules`` /
``_keep_in_fp32_modules_strict``; DeepSeek-V4 keeps every RMSNorm). transformers 5.17 — the GPU machines' — writes
those norms' forward as the T5/Llama one, ``self.weight * hidden_states.to(input_dtype)``: a float32 weight times
a bf16 tensor is float32, and the next bf16 linear refuses it (``expected mat1 and mat2 to have the same dtype``),
so a bf16 DeepSeek-V4 does not run at all on 5.17. Later releases (5.24, 5.25) return
``(self.weight * hidden_states).to(input_dtype)``.

``install(model)`` gives exactly that later forward to every module that (1) is named by the model's own
keep-in-float32 lists, (2) holds a float32 weight and (3) whose class forward is the canonical T5/Llama math (its AST, the same check as
``layers_impl``). Nothing else is touched: a norm whose weight follows the model's dtype keeps its class forward
(there the two spellings round differently), and on a release whose forward already casts back the AST differs
and nothing is installed. With a float32 input both spellings are the same arithmetic.

Called where a model is built: ``meta_model.build_meta_model`` (the engine) and ``launch.oracle.Reference`` (the
unsharded oracle), so both run the same norms.
"""

from __future__ import annotations

import functools
import types
from typing import Any

from .layers_impl import _CANONICAL_NORM, _same_code

#: the class attributes in which `transformers` names the modules it keeps in float32
KEEP_FP32_ATTRS = ("_keep_in_fp32_modules_strict", "_keep_in_fp32_modules")


@functools.cache
def _forward_drops_back_to_float32(cls: type) -> bool:
    """``cls.forward`` is the canonical norm (which, with a float32 weight, returns float32 for a bf16 input)."""
    return _same_code(cls.forward, _CANONICAL_NORM)


def dtype_keeping_norm_forward(self, hidden_states):
    """transformers 5.24's RMSNorm forward: the product in float32, one rounding to the input's dtype."""
    import torch

    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)


def kept_fp32_names(model: Any) -> frozenset[str]:
    """The module-name pieces the model's class keeps in float32 (empty for most models)."""
    names: set[str] = set()
    for attr in KEEP_FP32_ATTRS:
        names.update(getattr(model, attr, None) or ())
    return frozenset(names)


def _is_kept(qualified: str, kept: frozenset[str]) -> bool:
    """``transformers``' own rule for the keep lists: a listed piece matches whole dotted components."""
    padded = f".{qualified}."
    return any(f".{k}." in padded for k in kept)


def install(model: Any) -> int:
    """Put ``dtype_keeping_norm_forward`` on the kept-float32 canonical norms of ``model``; returns how many."""
    import torch

    kept = kept_fp32_names(model)
    if not kept:
        return 0
    n = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name and _is_kept(name, kept) and hasattr(module, "variance_epsilon") and weight is not None \
                and weight.dtype == torch.float32 and _forward_drops_back_to_float32(type(module)):
            module.forward = types.MethodType(dtype_keeping_norm_forward, module)
            n += 1
    return n
