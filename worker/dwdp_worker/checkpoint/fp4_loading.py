"""FP4 experts (MXFP4, NVFP4) on the discovered experts layout: what a rank shards, how dense NVFP4 is read,
and the experts forward over packed composites.

``fp4_layout(layout, qc, cmap, ckpt)``: every sharded weight of an experts module stored in FP4 becomes its
packed bytes plus its scales, as ``dwdp_runtime.quant`` declares them (``QuantScheme.expert_tensors``, the
projection as ``[out, in]``):

  * MXFP4 (gpt-oss): weight ``W`` uint8 ``[N, K/32, 16]`` from the checkpoint's ``W_blocks`` and
    ``W_scales`` uint8 ``[N, K/32]`` (E8M0), both FUSED ``[E, …]`` tensors: experts ``[a, b)`` are rows
    ``[a, b)`` — one byte range each. A module whose checkpoint has no ``W_blocks`` is stored unquantized
    (``modules_to_not_convert``) and loads as before.
  * NVFP4 (ModelOpt): weight ``W`` uint8 ``[N, K/2]`` resolved like an unquantized weight by `transformers`'
    conversion rules (per-expert ``experts.{e}.gate_proj.weight`` + ``up_proj``, or a fused ``W``), with
    the packed shape; ``W_weight_scale`` e4m3 ``[N, K/16]`` and ``W_weight_scale_2`` fp32 ``[S]`` (one per
    projection fused into ``W``: gate and up keep their own global scale) from the mirrored keys
    (``….weight`` → ``….weight_scale`` / ``….weight_scale_2``; fused ``W`` → ``W_weight_scale`` / …). A
    module whose weight is not stored as uint8 is unquantized (``exclude_modules``).

Every tensor is one more ``ExpertParam`` (role WEIGHT or SCALE): the loader reads a rank's experts only,
the transport, the page pool and the hooks move the packed bytes (¼ of bf16). The module's parameter
``W`` holds the packed composite between forwards; ``fp4_override`` makes its instance forward
``fp4_experts_forward``: on CUDA the weight-only FP4 Triton kernels (``model.fp4_experts_gpu``: FP4 → bf16 in
the weight load) where they cover the module; on CPU (and wherever they cannot run) it dequantizes the bound
composites exactly (``quant.fp4``), lays them out as the module's own parameter (transposed for gpt-oss)
and runs the class's configured forward: the sharded model is bitwise the unsharded dequantized one.

Refused (``UnsupportedModelError``): NVFP4 on transposed or interleaved experts (ModelOpt exports
``[out, in]`` per-expert projections), a checkpoint tensor of the wrong dtype or shape, K not a whole
number of FP4 groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dwdp_runtime.quant import QuantConfig, QuantFormat, TensorRole
from dwdp_runtime.quant import fp4

from ..model.attach import ForwardOverride
from ..model.experts_discovery import UnsupportedModelError
from ..model.fp4_experts_gpu import FP4_STATE_ATTR
from ..model.experts_layout import CheckpointSource, ExpertParam, ExpertsLayout, ModelLayout, ParamRole, SourceKind
from .names import CheckpointMap, resolve_sources
from .safetensors_index import CheckpointError

#: checkpoint suffixes of gpt-oss's MXFP4 tensors (`transformers`' ``Mxfp4HfQuantizer.serialized_names``)
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
#: ModelOpt NVFP4 suffixes appended to a weight key (``x.weight`` → ``x.weight_scale``, ``x.weight_scale_2``)
NVFP4_SCALE, NVFP4_SCALE_2 = "_scale", "_scale_2"


@dataclass(frozen=True)
class Fp4Projection:
    """One FP4 projection of an experts module: the packed weight, its scales and how the module holds it."""

    weight: str                     # module attribute: the packed codes between forwards
    scales: tuple[str, ...]         # MXFP4 (W_scales,); NVFP4 (W_weight_scale, W_weight_scale_2)
    row_segments: tuple[int, ...]   # output rows of the projections fused into W (NVFP4 global scales)
    transposed: bool                # the module's own parameter is [in, out] (gpt-oss)


@dataclass(frozen=True)
class Fp4Experts:
    """What ``fp4_experts_forward`` needs of one experts module (its ``FP4_STATE_ATTR``)."""

    format: QuantFormat
    projections: tuple[Fp4Projection, ...]
    compute_dtype: object

    def projection(self, weight: str) -> Fp4Projection:
        return next(p for p in self.projections if p.weight == weight)


def _out_in(e: ExpertsLayout, p: ExpertParam) -> tuple[int, int]:
    n, k = p.expert_shape
    return (k, n) if e.is_transposed else (n, k)


def _row_segments(e: ExpertsLayout, p: ExpertParam, rows: int) -> tuple[int, ...]:
    """A fused checkpoint tensor's projections: ``[gate; up]`` for a concatenated gate_up, else one."""
    if e.has_gate and e.is_concatenated and p.name.startswith("gate_up"):
        return (rows // 2, rows // 2)   # ModelOpt quantizes gate and up each with its own global scale
    return (rows,)


def _dtype_name(ckpt, key: str) -> str:
    return str(ckpt.entries[key].dtype).removeprefix("torch.")


def _check(ckpt, key: str, want_dtype: str, want_shape: tuple[int, ...], what: str) -> None:
    if key not in ckpt:
        raise CheckpointError(f"{what}: the FP4 checkpoint lacks {key}")
    got = _dtype_name(ckpt, key)
    if got != want_dtype:
        raise CheckpointError(f"{key}: stored as {got}; {what} declares {want_dtype}")
    shape = tuple(ckpt.shape(key))
    if shape != tuple(want_shape) and not (want_shape == (1,) and shape == ()):
        raise CheckpointError(f"{key}: shape {shape} != {tuple(want_shape)} declared for {what}")


def _mxfp4_experts(e: ExpertsLayout, qc: QuantConfig, cmap: CheckpointMap, ckpt):
    import torch

    weights = [p for p in e.params if p.role is ParamRole.WEIGHT]
    if not all(e.full_name(p.name) + MXFP4_BLOCKS in ckpt for p in weights):
        return resolve_sources(_one(e), cmap, ckpt.shape).experts[0], None   # stored unquantized
    plain = _one(dataclasses.replace(e, params=tuple(p for p in e.params if p.role is not ParamRole.WEIGHT)))
    resolved = {p.name: p for p in resolve_sources(plain, cmap, ckpt.shape).experts[0].params}
    params, extra, projections = [], [], []
    for p in e.params:
        if p.role is not ParamRole.WEIGHT:
            params.append(resolved[p.name])
            continue
        n, k = _out_in(e, p)
        w, s = _declared(qc, e, p, (n, k), ())
        full = e.full_name(p.name)
        for t, key in ((w, full + MXFP4_BLOCKS), (s, full + MXFP4_SCALES)):
            _check(ckpt, key, t.dtype, (e.num_experts, *t.expert_shape), f"MXFP4 {e.full_name(t.name)}")
        params.append(ExpertParam(p.name, ParamRole.WEIGHT, w.expert_shape, torch.uint8,
                                  CheckpointSource(SourceKind.FUSED, ((full + MXFP4_BLOCKS,),))))
        extra.append(ExpertParam(s.name, ParamRole.SCALE, s.expert_shape, torch.uint8,
                                 CheckpointSource(SourceKind.FUSED, ((full + MXFP4_SCALES,),))))
        projections.append(Fp4Projection(p.name, (s.name,), (n,), e.is_transposed))
    return dataclasses.replace(e, params=tuple(params)).with_params(*extra), tuple(projections)


def _declared(qc: QuantConfig, e: ExpertsLayout, p: ExpertParam, out_in: tuple[int, int], segs):
    try:
        return qc.scheme.expert_tensors(p.name, out_in, segs or None)
    except ValueError as exc:
        raise UnsupportedModelError(f"{e.full_name(p.name)} ({e.class_name}): {exc}") from None


def _one(e: ExpertsLayout) -> ModelLayout:
    return ModelLayout("", (e,))


def _mirror(src: CheckpointSource, suffix: str) -> CheckpointSource:
    return CheckpointSource(src.kind, tuple(tuple(k + suffix for k in part) for part in src.parts),
                            concat_dim=src.concat_dim)


def _nvfp4_experts(e: ExpertsLayout, qc: QuantConfig, cmap: CheckpointMap, ckpt):
    import torch

    weights = [p for p in e.params if p.role is ParamRole.WEIGHT]
    first = {p.name: next((m.key for m in cmap.matches(e.full_name(p.name))), None) for p in weights}
    if not any(k is not None and _dtype_name(ckpt, k) == "uint8" for k in first.values()):
        return resolve_sources(_one(e), cmap, ckpt.shape).experts[0], None   # stored unquantized
    if e.is_transposed or not e.is_concatenated:
        raise UnsupportedModelError(f"{e.path} ({e.class_name}): NVFP4 experts need [E, out, in] weights with "
                                    f"[gate; up] halves, as ModelOpt exports them (is_transposed={e.is_transposed}, "
                                    f"is_concatenated={e.is_concatenated})")
    packed = []
    for p in e.params:
        if p.role is ParamRole.WEIGHT:
            n, k = p.expert_shape
            if k % fp4.NVFP4_GROUP:
                raise UnsupportedModelError(f"{e.full_name(p.name)}: {k} input columns are not a whole number "
                                            f"of {fp4.NVFP4_GROUP}-element NVFP4 groups")
            p = dataclasses.replace(p, expert_shape=(n, k // 2), dtype=torch.uint8)
        packed.append(p)
    resolved = resolve_sources(_one(dataclasses.replace(e, params=tuple(packed))), cmap, ckpt.shape).experts[0]
    extra, projections = [], []
    for p, orig in zip(resolved.params, e.params):
        if p.role is not ParamRole.WEIGHT:
            continue
        src = p.source
        if src.kind is SourceKind.PER_EXPERT and src.concat_dim == 0 and len(src.parts) > 1:
            segs = tuple(ckpt.shape(part[0])[0] for part in src.parts)
        else:
            segs = _row_segments(e, orig, orig.expert_shape[0])
        w, s, s2 = _declared(qc, e, orig, tuple(orig.expert_shape), segs)
        for key in {k for part in src.parts for k in part}:
            if _dtype_name(ckpt, key) != "uint8":
                raise CheckpointError(f"{key}: stored as {_dtype_name(ckpt, key)}; NVFP4 experts are uint8")
        ssrc, s2src = _mirror(src, NVFP4_SCALE), _mirror(src, NVFP4_SCALE_2)
        _check_scales(ckpt, e, src, ssrc, s2src, s, segs)
        extra.append(ExpertParam(s.name, ParamRole.SCALE, s.expert_shape, torch.float8_e4m3fn, ssrc))
        extra.append(ExpertParam(s2.name, ParamRole.SCALE, s2.expert_shape, torch.float32, s2src))
        projections.append(Fp4Projection(p.name, (s.name, s2.name), segs, False))
    return resolved.with_params(*extra), tuple(projections)


def _check_scales(ckpt, e: ExpertsLayout, src, ssrc, s2src, s, segs) -> None:
    what = f"NVFP4 {e.full_name(s.name)}"
    if src.kind is SourceKind.FUSED:
        _check(ckpt, ssrc.parts[0][0], "float8_e4m3fn", (e.num_experts, *s.expert_shape), what)
        _check(ckpt, s2src.parts[0][0], "float32", (e.num_experts, len(segs)), what)
        return
    for wpart, spart, s2part in zip(src.parts, ssrc.parts, s2src.parts):
        for wk, sk, s2k in zip(wpart, spart, s2part):
            rows, half = ckpt.shape(wk)[-2:]
            _check(ckpt, sk, "float8_e4m3fn", (rows, 2 * half // fp4.NVFP4_GROUP), what)
            _check(ckpt, s2k, "float32", (1,), what)
    if src.concat_dim != 0 or len(src.parts) != len(segs):
        raise UnsupportedModelError(f"{e.full_name(s.name)}: NVFP4 projections must concatenate along rows")


def fp4_layout(layout: ModelLayout, qc: QuantConfig, cmap: CheckpointMap, ckpt
               ) -> tuple[ModelLayout, dict[str, Fp4Experts]]:
    """``layout`` (sources unresolved) with its sources and FP4 tensors; ``{path: Fp4Experts}`` of the FP4
    modules (``compute_dtype`` filled in by ``fp4_override``)."""
    build = _mxfp4_experts if qc.scheme.format is QuantFormat.MXFP4 else _nvfp4_experts
    done = [build(e, qc, cmap, ckpt) for e in layout.experts]
    specs = {e.path: Fp4Experts(qc.scheme.format, projections, None) for e, projections in done if projections}
    return layout.replace_experts(e for e, _ in done), specs


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
    return fp4.nvfp4_dequantize(value.to(device), ckpt.get(skey).to(device), ckpt.get(s2key), torch.float32)


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
    if spec.format is QuantFormat.MXFP4:
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
