"""DWDP's fused non-expert layers on CUDA: a one-pass RMSNorm and a one-launch RoPE, swapped into a
`transformers` model at the points `transformers` leaves for kernels.

Why: at ISL 16K the unfused norms (~7 elementwise kernels each, fp32 intermediates) and RoPE (5 per
tensor) are full HBM passes over ``[T, 2048]``-sized tensors, several ms of a prefill (docs/KERNELS.md).

What is swapped, and how (the same in transformers 5.17 and 5.24):
  * **RMSNorm** — every module whose class is one of ``NORM_CLASSES`` *and* whose ``forward`` is the
    T5/Llama math (checked on its source AST against ``_CANONICAL_NORM``; a variant such as Gemma's
    ``1 + weight`` is not, and keeps its own) gets ``dwdp_runtime.kernels.rmsnorm.rms_norm`` as its instance
    ``forward``. Those classes carry ``@use_kernel_forward_from_hub("RMSNorm")``: replacing the forward is
    transformers' own extension point; the module, its weight and its state dict are untouched. The fused
    forward falls back to the class's forward for any input the kernel does not cover (CPU tensors too).
  * **RoPE** — the modeling modules' ``apply_rotary_pos_emb`` (decorated ``@use_kernel_forward_from_hub
    ("rotary_pos_emb")``: a no-op without the ``kernels`` package, an ``nn.Module`` instance calling the
    function with it, as transformers 5.25 installs it; its code is checked on the module's source) is looked up as a module global by the
    attention forward at every call in both versions; that global is replaced by a dispatcher that runs
    ``kernels.rope.apply_rope`` for CUDA tensors it supports and the original otherwise. This is
    process-wide (a plain `transformers` model of the same architecture in the process gets it too, until the
    last installed model is uninstalled: ``_ROPE_OWNERS``), which is harmless by construction: the kernel keeps transformers' roundings element by element and is
    **bitwise equal** to the original (tests/gpu/test_layers_gpu.py). Only when the original's AST is
    the known one (``_CANONICAL_ROPE``); DeepSeek-V3's ``apply_rotary_pos_emb_interleave`` stays.

  * **float32-kept RMSNorms** (a compatibility fix, on CPU too; ``install_dtype_keeping_norms``, called where a
    model is built: ``meta_model.build_meta_model`` and ``launch.oracle.Reference``). A model may keep norms in
    float32 inside a bf16 model (``_keep_in_fp32_modules(_strict)``; DeepSeek-V4 keeps every RMSNorm), and
    transformers 5.17 writes their forward as the canonical one above, ``self.weight * hidden_states.to(
    input_dtype)`` — float32 — which the next bf16 linear refuses (``expected mat1 and mat2 to have the same
    dtype``): a bf16 DeepSeek-V4 does not run on 5.17 at all. 5.24 returns ``(self.weight * hidden_states).to(
    input_dtype)``; that forward goes on every module the model's keep lists name, holding a float32 weight, whose
    class forward is the canonical one. Nothing else changes: norms following the model's dtype keep their class
    forward (the two spellings round differently there), releases that already cast back are left alone (the AST
    differs), and with a float32 input both spellings are the same arithmetic.

``install(model)`` is called by ``attach.attach`` when it picks DWDP's kernels on CUDA — for the
engine *and* the unsharded oracle (``Reference(experts="auto")``), so both run the same kernels and stay
bitwise with each other. CPU models are never installed by the engine (the CPU path stays bitwise with
`transformers`); a CPU tensor reaching an installed forward takes the original unless Triton's interpreter
is on (``TRITON_INTERPRET=1``: the CPU tests run the kernels through whole models that way).
Invariants of the kernels (batch invariance, roundings) are in their module docstrings.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import logging
import sys
import textwrap
import types
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: RMSNorm classes whose forward is the T5/Llama math (transformers 5.17 and 5.24; checked again on the
#: source at install, so a later change of any of them falls back instead of computing something else)
NORM_CLASSES = frozenset({"Qwen3MoeRMSNorm", "MixtralRMSNorm", "DeepseekV3RMSNorm"})
#: modeling modules whose ``apply_rotary_pos_emb`` global the attention forwards call
ROPE_MODULES = ("transformers.models.qwen3_moe.modeling_qwen3_moe",
                "transformers.models.mixtral.modeling_mixtral",
                "transformers.models.deepseek_v3.modeling_deepseek_v3")

_CANONICAL_NORM = '''
def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
'''
_CANONICAL_ROPE = '''
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed
'''
_CANONICAL_ROTATE_HALF = '''
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
'''


@dataclass(frozen=True)
class Installed:
    """What ``install`` swapped in one model."""
    norms: int              # RMSNorm modules on the fused forward
    rope_modules: tuple     # modeling modules whose apply_rotary_pos_emb is the dispatcher


def _function_ast(src: str) -> str:
    """The AST of one function without its docstring, decorators and annotations' spelling of defaults."""
    node = ast.parse(textwrap.dedent(src)).body[0]
    assert isinstance(node, ast.FunctionDef)
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    node.body, node.decorator_list = body, []
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def _same_code(fn: Any, canonical: str) -> bool:
    try:
        return _function_ast(inspect.getsource(fn)) == _function_ast(canonical)
    except (OSError, TypeError, SyntaxError, AssertionError):
        return False


def _module_function_is(mod: Any, name: str, canonical: str) -> bool:
    """The ``def name`` written in ``mod``'s source is ``canonical`` (decorators aside). Read from the module's
    source rather than from the global: with the ``kernels`` package installed (a dependency of transformers
    5.25), ``@use_kernel_forward_from_hub`` turns a decorated function into an ``nn.Module`` instance that calls
    it, and ``inspect.getsource`` of that instance finds no code."""
    try:
        tree = ast.parse(inspect.getsource(mod))
    except (OSError, TypeError, SyntaxError):
        return False
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _function_ast(ast.unparse(node)) == _function_ast(canonical)
    return False


@functools.cache
def _forward_is_canonical_norm(cls: type) -> bool:
    """``cls.forward`` is the T5/Llama RMSNorm math (decided once per class: a model holds a few norms per layer,
    all of the same class, and the check reads and parses the source). With a float32 weight and a bf16 input it
    returns float32 (``install_dtype_keeping_norms``)."""
    return _same_code(cls.forward, _CANONICAL_NORM)


def norm_is_canonical(cls: type) -> bool:
    """``cls`` is a known RMSNorm class whose forward is the T5/Llama math."""
    return cls.__name__ in NORM_CLASSES and _forward_is_canonical_norm(cls)


def fused_norm_forward(self, hidden_states):
    """The RMSNorm forward installed on supported modules: one Triton pass where the kernels run (CUDA, or the
    CPU under Triton's interpreter in tests), the class's own forward otherwise."""
    from dwdp_runtime.kernels import available, rmsnorm

    if available(hidden_states.device) and rmsnorm.supports(hidden_states, self.weight):
        return rmsnorm.rms_norm(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def install_norms(model: Any) -> int:
    """Put ``fused_norm_forward`` on every canonical RMSNorm module of ``model``; returns how many."""
    n = 0
    for module in model.modules():
        if norm_is_canonical(type(module)):
            module.forward = types.MethodType(fused_norm_forward, module)
            n += 1
    return n


def uninstall_norms(model: Any) -> None:
    for module in model.modules():
        if getattr(module.forward, "__func__", None) is fused_norm_forward:
            del module.forward


def _rope_dispatcher(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        from dwdp_runtime.kernels import available, rope

        if available(q.device) and rope.supports(q, k, cos, sin, unsqueeze_dim):
            return rope.apply_rope(q, k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.__wrapped__ = original
    apply_rotary_pos_emb._dwdp_fused = True
    return apply_rotary_pos_emb


#: the models (by ``id``) that run on each patched modeling module's ``apply_rotary_pos_emb``: the global is
#: process-wide, so the patch stays while any attached model uses it and the last owner's uninstall restores it
_ROPE_OWNERS: dict[str, set[int]] = {}


def install_rope(module_name: str, owner: int = 0) -> bool:
    """Replace ``module_name.apply_rotary_pos_emb`` by the dispatcher for ``owner`` (idempotent); False when the
    module's function (or its ``rotate_half``) is not the known code."""
    mod = sys.modules.get(module_name) or importlib.import_module(module_name)
    fn = getattr(mod, "apply_rotary_pos_emb", None)
    if fn is None:
        return False
    if not getattr(fn, "_dwdp_fused", False):
        if not (_module_function_is(mod, "apply_rotary_pos_emb", _CANONICAL_ROPE)
                and _module_function_is(mod, "rotate_half", _CANONICAL_ROTATE_HALF)):
            return False
        mod.apply_rotary_pos_emb = _rope_dispatcher(fn)
    _ROPE_OWNERS.setdefault(module_name, set()).add(owner)
    return True


def uninstall_rope(module_name: str, owner: int = 0) -> None:
    """``owner`` no longer runs on the dispatcher; the last owner's call puts the original back."""
    owners = _ROPE_OWNERS.setdefault(module_name, set())
    owners.discard(owner)
    mod = sys.modules.get(module_name)
    fn = getattr(mod, "apply_rotary_pos_emb", None) if mod else None
    if not owners and getattr(fn, "_dwdp_fused", False):
        mod.apply_rotary_pos_emb = fn.__wrapped__


def _rope_modules_of(model: Any) -> tuple[str, ...]:
    """The ``ROPE_MODULES`` that define classes used in ``model``."""
    used = {type(m).__module__ for m in model.modules()}
    return tuple(name for name in ROPE_MODULES if name in used)


def install(model: Any, *, norms: bool = True, rope: bool = True) -> Installed:
    """Swap the fused layers into ``model`` (see module docstring); CUDA inputs only take the kernels."""
    n = install_norms(model) if norms else 0
    done = tuple(name for name in _rope_modules_of(model) if rope and install_rope(name, id(model)))
    log.info("fused layers: %d RMSNorm modules, RoPE in %s", n, ", ".join(done) or "none")
    return Installed(norms=n, rope_modules=done)


def uninstall(model: Any) -> None:
    """Undo ``install`` (``Attachment.close``, the bench's A/B). The RoPE global goes back to transformers'
    function once no installed model of the process runs on it (it is one global per modeling module)."""
    uninstall_norms(model)
    for name in _rope_modules_of(model):
        uninstall_rope(name, id(model))


#: the class attributes in which `transformers` names the modules it keeps in float32
KEEP_FP32_ATTRS = ("_keep_in_fp32_modules_strict", "_keep_in_fp32_modules")


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


def install_dtype_keeping_norms(model: Any) -> int:
    """Put ``dtype_keeping_norm_forward`` on the kept-float32 canonical norms of ``model``; returns how many."""
    import torch

    kept = kept_fp32_names(model)
    if not kept:
        return 0
    n = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name and _is_kept(name, kept) and hasattr(module, "variance_epsilon") and weight is not None \
                and weight.dtype == torch.float32 and _forward_is_canonical_norm(type(module)):
            module.forward = types.MethodType(dtype_keeping_norm_forward, module)
            n += 1
    return n
