"""The FP4 experts forward over packed composites, and dense NVFP4 read at load.

The layout (what is sharded, from which checkpoint keys) is ``fp4_layout``'s. Between forwards an FP4
experts module's parameter ``W`` holds the packed composite; ``fp4_override`` makes its instance forward
``fp4_experts_forward``: on CUDA the weight-only FP4 Triton kernels (``model.fp4_experts_gpu``: FP4 → bf16 in
the weight load) where they cover the module; on CPU (and wherever they cannot run) it dequantizes the bound
composites exactly (``quant.fp4``), lays them out as the module's own parameter (transposed for gpt-oss) and
runs the class's configured forward: the sharded model is bitwise the unsharded dequantized one.

``read_dense_nvfp4``: a replicated ModelOpt NVFP4 linear (attention, dense MLPs, shared experts) is
dequantized at load (float32 on the load device; the loader casts it to the compute dtype).
"""

from __future__ import annotations

import dataclasses

from dwdp_runtime.quant import QuantFormat
from dwdp_runtime.quant import fp4

from ..model.attach import ForwardOverride
from ..model.fp4_experts_gpu import FP4_STATE_ATTR
from .fp4_layout import NVFP4_SCALE, NVFP4_SCALE_2, Fp4Experts, Fp4Projection, fp4_layout
from .safetensors_index import CheckpointError

__all__ = ["Fp4Experts", "Fp4Projection", "fp4_layout", "fp4_override", "fp4_experts_forward", "read_dense_nvfp4",
           "dequantized_forward"]


def read_dense_nvfp4(ckpt, key: str, value, device):
    """A dense ModelOpt NVFP4 weight (uint8 + ``weight_scale`` e4m3 + ``weight_scale_2``) dequantized to
    float32 on ``device``; None when ``key`` is not one."""
    import torch

    skey = key + NVFP4_SCALE
    if value.dtype != torch.uint8 or skey not in ckpt or ckpt.entries[skey].dtype != torch.float8_e4m3fn:
        return None
    s2key = key + NVFP4_SCALE_2
    if s2key not in ckpt:
        raise CheckpointError(f"{key} is NVFP4 (uint8 + {skey}) but the checkpoint has no {s2key}")
    return fp4.nvfp4_dequantize(value.to(device), ckpt.get(skey).to(device), ckpt.get(s2key).to(device),
                               torch.float32)


def fp4_override(path: str, spec: Fp4Experts, compute_dtype) -> ForwardOverride:
    """The experts module at ``path`` (FP4 composites bound) computing through ``fp4_experts_forward``."""
    return ForwardOverride(path=path, forward=fp4_experts_forward, state_attr=FP4_STATE_ATTR,
                           state=dataclasses.replace(spec, compute_dtype=compute_dtype))


def fp4_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The weight-only FP4 kernels on CUDA where they cover the module (``model.fp4_experts_gpu``), else the
    exact dequantized forward."""
    from ..model import fp4_experts_gpu

    if fp4_experts_gpu.unsupported_reason(self, hidden_states) is None:
        return fp4_experts_gpu.forward(self, hidden_states, top_k_index, top_k_weights)
    return dequantized_forward(self, hidden_states, top_k_index, top_k_weights)


def dequantize_projection(spec: Fp4Experts, proj: Fp4Projection, params, dtype):
    """The module's own parameter (``[E, out, in]``, or ``[E, in, out]`` transposed) from bound FP4 composites."""
    if spec.format in (QuantFormat.MXFP4, QuantFormat.FP4_UE8M0):   # one math: E2M1 · 2^(e − 127)
        w = fp4.mxfp4_dequantize(params[proj.weight], params[proj.scales[0]], dtype)
    else:
        w = fp4.nvfp4_dequantize(params[proj.weight], params[proj.scales[0]], params[proj.scales[1]], dtype,
                                 row_segments=proj.row_segments)
    return w.transpose(-2, -1).contiguous() if proj.transposed else w


def dequantized_forward(self, hidden_states, top_k_index, top_k_weights):
    """The reference path: dequantize the bound composites, run the class's configured experts forward."""
    import torch

    spec: Fp4Experts = getattr(self, FP4_STATE_ATTR)
    params = self._parameters
    saved = {p.weight: params[p.weight] for p in spec.projections}
    try:
        dequantized = {p.weight: dequantize_projection(spec, p, params, spec.compute_dtype) for p in spec.projections}
        for name, w in dequantized.items():
            params[name] = torch.nn.Parameter(w, requires_grad=False)
        del dequantized
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    finally:
        params.update(saved)
