"""The fused router inside a model (opt-in: ``attach(fused_router=True)``): router modules' instance ``forward``.

For each `transformers` router module whose outputs are ``(router_logits, top_k_weights, top_k_index)``
(Qwen3-MoE / Mixtral ``…TopKRouter``, DeepSeek-V3 ``DeepseekV3TopkRouter`` in transformers 5.x), the
instance ``forward`` becomes: the same gate GEMM (``F.linear``, fp32 operands for sigmoid routers, as the
classes do) then ``dwdp_runtime.kernels.router.route`` — one launch instead of 5 (Qwen3) or ~15 (DeepSeek-V3).
The index tensor it returns carries the chunk counts the router wrote (attribute ``COUNTS_ATTR``) and the
experts forward (``experts_impl.dwdp_experts_forward``) hands them to the alignment, which then skips its count
kernel. The tensor object travels unchanged from the router to the experts in these blocks' forwards; anything
else that reaches the experts (another caller, a copy) simply has no attribute and the alignment counts itself.

Install is **behavioural**, not by class name alone: on a probe of ``PROBE_TOKENS`` random rows on the module's
device the original forward must return that triple, and ours the same expert sets with weights within the
router's documented tolerance (``router.WEIGHT_RTOL``, or one bf16 step); a module that fails (another
`transformers` version's semantics, an unknown router) keeps its forward, logged once. Off by default: the
numbers move by the router's stated tolerance (ties of bf16 logits may pick another expert of the same score),
so the engine and the oracle must both opt in to stay comparable bitwise.
"""

from __future__ import annotations

import logging
import types
from typing import Any

log = logging.getLogger(__name__)

#: the attribute of the returned index tensor that holds ``router.Routed.counts``
COUNTS_ATTR = "_dwdp_router_counts"
#: router classes tried (others are never touched)
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "MixtralTopKRouter", "DeepseekV3TopkRouter")
PROBE_TOKENS = 64


def _fused_forward(self, hidden_states):
    import torch.nn.functional as F

    from dwdp_runtime.kernels import router

    spec = self._dwdp_router_spec
    x = hidden_states.reshape(-1, self.hidden_dim)
    if spec.score == "sigmoid":
        logits = F.linear(x.float(), self.weight.float())
    else:
        logits = F.linear(x, self.weight)
    routed = router.route(logits, spec, getattr(self, "e_score_correction_bias", None))
    ids = routed.topk_ids
    if routed.counts is not None:
        setattr(ids, COUNTS_ATTR, routed.counts)
    return logits, routed.topk_weights, ids


def _agrees(module, original, device) -> str | None:
    """None when ours reproduces ``original`` on a probe, else why not."""
    import torch

    from dwdp_runtime.kernels import router

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(PROBE_TOKENS, module.hidden_dim, generator=gen).to(device=device, dtype=module.weight.dtype)
    with torch.no_grad():
        want = original(x)
        if not (isinstance(want, tuple) and len(want) == 3):
            return f"its forward returns {type(want).__name__}, not (logits, weights, ids)"
        got = _fused_forward(module, x)
    _, w_want, i_want = want
    _, w_got, i_got = got
    if w_want.dtype != w_got.dtype or i_want.shape != i_got.shape:
        return f"outputs {w_want.dtype}/{tuple(i_want.shape)} vs ours {w_got.dtype}/{tuple(i_got.shape)}"
    a, b = torch.sort(i_want.long(), -1), torch.sort(i_got.long(), -1)
    if not torch.equal(a.values, b.values):
        return "another expert choice on the probe"
    wa, wb = torch.gather(w_want.float(), 1, a.indices), torch.gather(w_got.float(), 1, b.indices)
    tol = router.WEIGHT_RTOL if w_want.dtype == torch.float32 else 2.0 ** -7
    if not torch.allclose(wb, wa, rtol=tol, atol=0):
        return f"weights differ by {(wb - wa).abs().max().item():.3g}"
    return None


def install(model: Any, device: Any) -> list:
    """Swap the router forwards that pass the probe (module docstring); returns the modules swapped."""
    from dwdp_runtime.kernels import router

    swapped = []
    for name, module in model.named_modules():
        if type(module).__name__ not in ROUTER_CLASSES or "forward" in module.__dict__:
            continue
        try:
            module._dwdp_router_spec = router.of_module(module, module.weight.dtype)
            why = _agrees(module, module.forward, device)
        except (ValueError, AttributeError, RuntimeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:
            module.__dict__.pop("_dwdp_router_spec", None)
            log.warning("fused router not installed on %s (%s): %s", name, type(module).__name__, why)
            continue
        module.forward = types.MethodType(_fused_forward, module)
        swapped.append(module)
    return swapped


def uninstall(modules: list) -> None:
    for module in modules:
        module.__dict__.pop("forward", None)
        module.__dict__.pop("_dwdp_router_spec", None)
