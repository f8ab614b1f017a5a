"""FP8 dense linears: an FP8 block-scaled checkpoint's attention projections, dense MLPs and shared experts kept
in e4m3 (+ their 128×128 ``weight_scale_inv``) instead of dequantized to the compute dtype at load (issue #34).

``DWDP_FP8_DENSE`` (``contract.TuningEnv.FP8_DENSE``, read at load): ``off`` (default) dequantizes at load as
before; ``on`` keeps every eligible ``nn.Linear`` weight in FP8. Off by default: measured on an H100
(2026-12-06, ``bench/fp8_prefill.py --fp8-dense``, docs/KERNELS.md "Issue #34") it bought 1.7 % end to end at
the Qwen3 shape, where the dense linears are a small share of the FLOPs.

Eligible (``source``): a module of exact type ``nn.Linear`` (not ``lm_head``, which the released checkpoints
keep unquantized), whose ``weight`` is one checkpoint key stored float8_e4m3fn with its block scales (fp32, or
DeepSeek-V4's E8M0) — a tensor a ``transformers`` converter splits or fuses (q, k, v from a fused qkv) is
dequantized as before, since its row blocks need not align with the split.

Forward (``fp8_linear_forward``, the instance's ``forward``): on an sm_90 GPU with the CuTe kernels and a
128-multiple weight, ``kernels.fp8_linear.fp8_block_linear`` (activations quantized per token and 128-column group); anywhere
else the weight is dequantized with ``fp8_block.dequantize`` — the function the load-time path uses — to the
compute dtype for that one call, so on CPU the model's output is bitwise the dequantize-at-load model's.

Invariant: a kept linear's ``weight`` parameter is e4m3 ``[out, in]`` and its ``weight_scale_inv`` buffer fp32;
the compute dtype the load would have given the weight is the module's ``FP8_DENSE_DTYPE_ATTR``.
"""

from __future__ import annotations

import types

from dwdp_runtime.contract import Switch, TuningEnv, tuning_choice

from .fp4_layout import ue8m0_scale_key
from .safetensors_index import CheckpointError

#: the buffer holding a kept linear's block scales (the checkpoint's name for them)
SCALE_BUFFER = "weight_scale_inv"
#: the module attribute holding the dtype a dequantized weight takes (the load's target dtype)
FP8_DENSE_DTYPE_ATTR = "_dwdp_fp8_dense_dtype"
#: the released FP8 checkpoints keep the LM head unquantized; never keep it FP8 even if a checkpoint did not
UNQUANTIZED_MODULES = ("lm_head",)


def mode() -> Switch:
    """``DWDP_FP8_DENSE``; an unknown value is an error naming the accepted ones."""
    return tuning_choice(TuningEnv.FP8_DENSE, Switch, Switch.OFF)


def source(model, name: str, cmap, ckpt) -> tuple[str, str] | None:
    """(weight key, scale key) when dense parameter ``name`` is kept FP8 (module docstring), else None: the
    ``weight`` of an exact ``nn.Linear`` but ``lm_head``, one checkpoint key stored float8_e4m3fn."""
    import torch

    module_name, _, attr = name.rpartition(".")
    if attr != "weight" or module_name.rpartition(".")[2] in UNQUANTIZED_MODULES:
        return None
    if type(model.get_submodule(module_name)) is not torch.nn.Linear:
        return None
    matches = cmap.matches(name)
    if len(matches) != 1 or matches[0].converter is not None:
        return None  # split or fused by a converter: the row blocks need not align with the parts
    key = matches[0].key
    if key not in ckpt or ckpt.entries[key].dtype != torch.float8_e4m3fn:
        return None
    scale_key = ue8m0_scale_key(ckpt, key)  # ``x.weight_scale_inv``, or DeepSeek-V4's own ``x.scale``
    if scale_key not in ckpt:
        raise CheckpointError(f"{key} is float8_e4m3fn but the checkpoint has no {scale_key}")
    return key, scale_key


def load(model, name: str, cmap, ckpt, device, compute_dtype) -> int | None:
    """Read dense parameter ``name`` kept FP8 onto ``device`` and install it (``keep_fp8``): the bytes held, or None
    when it is not kept (``DWDP_FP8_DENSE`` off, or not eligible: ``source``) and the loader reads it as before."""
    keys = source(model, name, cmap, ckpt) if mode() is Switch.ON else None
    if keys is None:
        return None
    weight, scale = (ckpt.get(k, device) for k in keys)
    return keep_fp8(model.get_submodule(name.rpartition(".")[0]), weight, scale, compute_dtype, name=name)


def keep_fp8(module, weight, scale, compute_dtype, *, name: str = "weight") -> int:
    """Install FP8 ``weight`` [out, in] and its block ``scale`` on the ``nn.Linear`` ``module``; bytes held.
    ``name``: the parameter's, for the error a mismatched shape raises."""
    import torch

    from dwdp_runtime.quant import FP8_BLOCK

    out_features, in_features = weight.shape
    if (out_features, in_features) != (module.out_features, module.in_features):
        raise CheckpointError(f"{name}: checkpoint shape {tuple(weight.shape)} != model shape "
                              f"{(module.out_features, module.in_features)} (config.json does not match the weights)")
    want = (-(-out_features // FP8_BLOCK[0]), -(-in_features // FP8_BLOCK[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"block scales {tuple(scale.shape)} do not fit a {tuple(weight.shape)} weight in "
                         f"{FP8_BLOCK[0]}×{FP8_BLOCK[1]} blocks (want {want})")
    scale = scale.to(device=weight.device, dtype=torch.float32).contiguous()
    module._parameters["weight"] = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    module._buffers[SCALE_BUFFER] = scale
    setattr(module, FP8_DENSE_DTYPE_ATTR, compute_dtype)
    module.forward = types.MethodType(fp8_linear_forward, module)
    return weight.numel() * weight.element_size() + scale.numel() * scale.element_size()


def dequantized_weight(module):
    """The weight the load would have set: ``fp8_block.dequantize`` in float32, rounded to the compute dtype."""
    import torch

    from dwdp_runtime.quant import fp8_block

    value = fp8_block.dequantize(module.weight, module._buffers[SCALE_BUFFER], torch.float32)
    return value.to(getattr(module, FP8_DENSE_DTYPE_ATTR))


def fp8_linear_forward(self, input):
    import torch.nn.functional as F

    from dwdp_runtime.kernels import fp8_linear

    scale = self._buffers[SCALE_BUFFER]
    if fp8_linear.unusable(input, self.weight) is None:
        return fp8_linear.fp8_block_linear(input, self.weight, scale, self.bias)
    return F.linear(input, dequantized_weight(self), self.bias)


def kept_linears(model) -> list[str]:
    """Names of the modules holding FP8 dense weights."""
    return [n for n, m in model.named_modules() if hasattr(m, FP8_DENSE_DTYPE_ATTR)]
