"""The model side of quantized checkpoints: the discovered experts layout plus the quantization's tensors,
how dense FP8/NVFP4 is read, and the experts forward over FP8 composites (FP4: ``fp4_loading``).

  * ``resolve_layout(layout, qc, cmap, ckpt)``: the discovered layout with every checkpoint source resolved
    and the quantization's sharded tensors declared; ``quantized`` maps each quantized experts module to
    what its forward reads (``Fp8Pair``s, or ``fp4_loading.Fp4Experts``), ``overrides`` turns that into the
    ``ForwardOverride``s the loader returns (``model.attach`` installs them).
  * ``quantize_layout(layout, qc, ckpt)`` (FP8, sources resolved): every sharded weight of the discovered
    ``ExpertsLayout`` (``experts_layout``, from ``experts_discovery`` + ``checkpoint_names``) becomes float8_e4m3fn
    and gains a ``<name>_scale_inv`` ``ExpertParam`` (role SCALE, fp32 ``[Σ⌈n_i/128⌉, ⌈K/128⌉]``) whose
    checkpoint source mirrors the weight's (per-expert ``….weight`` → ``….weight_scale_inv``, fused ``X`` →
    ``X_scale_inv``) — the declaration is ``dwdp_runtime.quant``'s; the loader, transport and hooks treat
    the scales like any other ``[E, ...]`` tensor. Row segments (gate, up) come from the weight's parts.
  * ``dense_reader(ckpt, device)``: reads a replicated tensor; an FP8 one (e4m3 + ``weight_scale_inv``, fp32 or
    DeepSeek-V4's E8M0, which DeepSeek names ``….scale``) or
    a ModelOpt NVFP4 one (uint8 + ``weight_scale`` + ``weight_scale_2``) is **dequantized at load**
    (attention, dense MLPs, shared experts; float32 on the load device, then cast to the compute dtype by
    the loader): 2 bytes per weight in bf16 instead of 1 + 4/16384 — DeepSeek-V3: ≈ 15 GiB more per rank
    than keeping them in FP8.
  * ``fp8_override(path, …)``: the experts module keeps its `transformers` class and its configured
    experts implementation; its instance ``forward`` becomes ``fp8_experts_forward`` (installed by ``model.attach``). On CUDA with Triton that
    runs the block-scaled grouped GEMM (``dwdp_runtime.kernels.fp8_moe``) straight over the composites; on
    CPU (and wherever Triton cannot run) it dequantizes the bound composites with ``fp8_block.dequantize`` —
    the one definition the dequantized reference checkpoint is written with — and runs the class's own
    forward on them, so its output equals the reference's bitwise.

Invariant: between forwards the module's parameters are the quantized composites (the hooks bind them); the
dequantized tensors exist only inside one experts forward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dwdp_runtime.quant import QuantConfig, TensorRole, parse_quantization_config
from dwdp_runtime.quant import fp8_block

from ..model.attach import ForwardOverride
from ..model.experts_discovery import UnsupportedModelError
from ..model import fp8_experts_gpu
from ..model.fp8_experts_gpu import FP8_STATE_ATTR
from ..model.experts_layout import CheckpointSource, ExpertParam, ExpertsLayout, ModelLayout, ParamRole, SourceKind
from . import fp4_loading
from .fp4_layout import ue8m0_scale_key
from .names import CheckpointMap, resolve_sources
from .safetensors_index import CheckpointError

#: checkpoint dtype names (safetensors index) the FP8 scheme declares, by role
_STORED = {TensorRole.WEIGHT: "float8_e4m3fn", TensorRole.SCALE: "float32"}


@dataclass(frozen=True)
class Fp8Pair:
    """One quantized projection of an experts module: its weight, its scale and the weight's row segments."""

    weight: str
    scale: str
    row_segments: tuple[int, ...]


def quant_config_of(config: Any) -> QuantConfig:
    return parse_quantization_config(getattr(config, "quantization_config", None))


def scale_key(weight_key: str) -> str:
    """Checkpoint key of a weight's block scales: ``x.weight`` → ``x.weight_scale_inv``, fused ``x`` → ``x_scale_inv``."""
    return weight_key + "_scale_inv"


def _row_segments(e: ExpertsLayout, p: ExpertParam, ckpt) -> tuple[int, ...]:
    src = p.source
    if src.kind is SourceKind.PER_EXPERT and src.concat_dim == 0 and len(src.parts) > 1:
        return tuple(ckpt.shape(part[0])[0] for part in src.parts)
    if src.kind is SourceKind.FUSED and e.has_gate and p.name.startswith("gate_up"):
        return (p.expert_shape[0] // 2, p.expert_shape[0] // 2)  # [gate; up], quantized separately
    return (p.expert_shape[0],)


def _check_stored(ckpt, keys, role: TensorRole, full: str) -> None:
    want = _STORED[role]
    for key in keys:
        if key not in ckpt:
            raise CheckpointError(f"{full}: the FP8 checkpoint lacks {key}")
        got = str(ckpt.entries[key].dtype).removeprefix("torch.")
        if got != want:
            raise CheckpointError(f"{key}: stored as {got}; the checkpoint's quantization_config (fp8 block) "
                                  f"declares {want} for the experts' {role.value} tensors")


def _quantize_experts(e: ExpertsLayout, qc: QuantConfig, ckpt) -> tuple[ExpertsLayout, tuple[Fp8Pair, ...]]:
    import torch

    if e.is_transposed or not e.is_concatenated:
        raise UnsupportedModelError(f"{e.path} ({e.class_name}): FP8 block-scaled experts need [E, out, in] weights "
                                    f"with [gate; up] halves (is_transposed={e.is_transposed}, "
                                    f"is_concatenated={e.is_concatenated}); `transformers`' FP8Experts has the same rule")
    params, scales, pairs = [], [], []
    for p in e.params:
        if p.role is not ParamRole.WEIGHT:
            params.append(p)
            continue
        segs = _row_segments(e, p, ckpt)
        w, s = qc.scheme.expert_tensors(p.name, tuple(p.expert_shape), segs)
        src = p.source
        sparts = tuple(tuple(scale_key(k) for k in part) for part in src.parts)
        _check_stored(ckpt, {k for part in src.parts for k in part}, TensorRole.WEIGHT, e.full_name(p.name))
        _check_stored(ckpt, {k for part in sparts for k in part}, TensorRole.SCALE, e.full_name(s.name))
        if src.kind is SourceKind.FUSED:
            got = tuple(ckpt.shape(sparts[0][0]))
            if got != (e.num_experts, *s.expert_shape):
                raise CheckpointError(f"{sparts[0][0]}: shape {got} != {(e.num_experts, *s.expert_shape)} for "
                                      f"{128}x{128} blocks of {e.full_name(p.name)} (segments {segs})")
        params.append(dataclasses.replace(p, dtype=torch.float8_e4m3fn))
        scales.append(ExpertParam(s.name, ParamRole.SCALE, s.expert_shape, torch.float32,
                                  CheckpointSource(src.kind, sparts, concat_dim=src.concat_dim)))
        pairs.append(Fp8Pair(p.name, s.name, segs))
    return dataclasses.replace(e, params=tuple(params)).with_params(*scales), tuple(pairs)


def quantize_layout(layout: ModelLayout, qc: QuantConfig, ckpt) -> tuple[ModelLayout, dict[str, tuple[Fp8Pair, ...]]]:
    """``layout`` (sources resolved) with the quantization's sharded tensors; ``{path: pairs}`` ({} unquantized)."""
    if not qc.quantized:
        return layout, {}
    done = [_quantize_experts(e, qc, ckpt) for e in layout.experts]
    return layout.replace_experts(e for e, _ in done), {e.path: pairs for e, pairs in done}


def resolve_layout(layout: ModelLayout, qc: QuantConfig, cmap: CheckpointMap, ckpt) -> tuple[ModelLayout, dict]:
    """``layout`` with its checkpoint sources and the quantization's tensors; ``{path: what its forward reads}``
    for the quantized experts modules ({} unquantized)."""
    if qc.scheme.is_fp4:
        return fp4_loading.fp4_layout(layout, qc, cmap, ckpt)
    return quantize_layout(resolve_sources(layout, cmap, ckpt.shape), qc, ckpt)


def overrides(quantized: dict, compute_dtype) -> tuple[ForwardOverride, ...]:
    """The experts forwards of ``resolve_layout``'s quantized modules (``model.attach`` installs them)."""
    return tuple(fp4_loading.fp4_override(path, spec, compute_dtype) if isinstance(spec, fp4_loading.Fp4Experts)
                 else fp8_override(path, spec, compute_dtype) for path, spec in quantized.items())


def dense_reader(ckpt, device=None):
    """``read(key)`` for the dense load: FP8 and NVFP4 tensors dequantized (float32, on ``device``), others
    as stored, on ``device`` (into GPU memory through pinned staging: ``device_staging``)."""
    import torch

    def read(key: str):
        stored = ckpt.entries[key].dtype
        if stored not in (torch.uint8, torch.float8_e4m3fn):
            return ckpt.get(key, device)  # as stored, read straight onto the load device
        value = ckpt.get(key)
        if value.dtype == torch.uint8:
            dequantized = fp4_loading.read_dense_nvfp4(ckpt, key, value, device)
            return value if dequantized is None else dequantized
        if value.dtype != torch.float8_e4m3fn:
            return value
        skey = ue8m0_scale_key(ckpt, key)  # ``x.weight_scale_inv``, or DeepSeek-V4's own ``x.scale``
        if skey not in ckpt:
            raise CheckpointError(f"{key} is float8_e4m3fn but the checkpoint has no {skey}")
        return fp8_block.dequantize(value.to(device), ckpt.get(skey), torch.float32)  # fp32 or E8M0 scales

    return read


def fp8_override(path: str, pairs: tuple[Fp8Pair, ...], compute_dtype) -> ForwardOverride:
    """The experts module at ``path`` (FP8 composites bound) computing through ``fp8_experts_forward``
    (``model.attach`` installs it and undoes it)."""
    state = (tuple((p.weight, p.scale, p.row_segments) for p in pairs), compute_dtype)
    return ForwardOverride(path=path, forward=fp8_experts_forward, state_attr=FP8_STATE_ATTR, state=state)


def fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    if fp8_experts_gpu.unsupported_reason(self, hidden_states) is None:
        return fp8_experts_gpu.forward(self, hidden_states, top_k_index, top_k_weights)
    return dequantized_forward(self, hidden_states, top_k_index, top_k_weights)


def dequantized_forward(self, hidden_states, top_k_index, top_k_weights):
    """The reference path: dequantize the bound composites, run the class's configured experts forward."""
    import torch

    pairs, dtype = getattr(self, FP8_STATE_ATTR)
    params = self._parameters
    saved = {w: params[w] for w, _, _ in pairs}
    try:
        for w, s, segs in pairs:
            params[w] = torch.nn.Parameter(fp8_block.dequantize(saved[w], params[s], dtype, row_segments=segs),
                                           requires_grad=False)
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    finally:
        params.update(saved)


def mapped_memory(manager, layout: ModelLayout, compute_dtype):
    """What ``manager`` maps for the layout's experts, by part — ``quant.layers_memory``, the planner's function."""
    import torch

    from dwdp_runtime.quant import ExpertTensor, layers_memory

    def decl(p: ExpertParam) -> ExpertTensor:  # biases are weights here: the planner's "weights" part
        role = TensorRole.SCALE if p.role is ParamRole.SCALE else TensorRole.WEIGHT
        return ExpertTensor(p.name, role, str(p.dtype).removeprefix("torch."), tuple(p.expert_shape), "", ())

    return layers_memory(layers=[[decl(p) for p in e.params] for e in layout.experts],
                         num_experts=manager.config.num_experts, ranges=manager.ranges, rank=manager.rank,
                         slots=manager.config.num_prefetch_slots, granularity=manager.memory.granularity,
                         compute_itemsize=torch.empty((), dtype=compute_dtype).element_size(),
                         page_multiplier=manager.buffer.page_multiplier)
