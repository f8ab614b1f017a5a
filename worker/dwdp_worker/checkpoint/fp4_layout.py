"""FP4 experts (MXFP4, NVFP4, DeepSeek-V4's FP4) on the discovered experts layout: what a rank shards.

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
  * FP4 with E8M0 scales (DeepSeek-V4, ``expert_dtype: fp4``): weight ``W`` int8 ``[N, K/2]`` resolved as
    NVFP4's, ``W_scale_inv`` E8M0 ``[N, K/32]`` from ``….weight_scale_inv`` (`transformers`' name) or
    ``….scale`` (DeepSeek's own, which `transformers`' FP8 quantizer renames the same way).

Every tensor is one more ``ExpertParam`` (role WEIGHT or SCALE): the loader reads a rank's experts only,
the transport, the page pool and the hooks move the packed bytes (¼ of bf16).

Refused (``UnsupportedModelError``): per-expert FP4 (NVFP4, DeepSeek-V4) on transposed or interleaved experts
(their exporters write ``[out, in]`` per-expert projections), a checkpoint tensor of the wrong dtype or shape,
K not a whole number of FP4 groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dwdp_runtime.quant import QuantConfig, QuantFormat
from dwdp_runtime.quant import fp4

from ..model.experts_discovery import UnsupportedModelError
from ..model.experts_layout import CheckpointSource, ExpertParam, ExpertsLayout, ModelLayout, ParamRole, SourceKind
from .names import CheckpointMap, resolve_sources
from .safetensors_index import CheckpointError

#: checkpoint suffixes of gpt-oss's MXFP4 tensors (`transformers`' ``Mxfp4HfQuantizer.serialized_names``)
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
#: ModelOpt NVFP4 suffixes appended to a weight key (``x.weight`` → ``x.weight_scale``, ``x.weight_scale_2``)
NVFP4_SCALE, NVFP4_SCALE_2 = "_scale", "_scale_2"
#: DeepSeek-V4's FP4 experts: `transformers`' scale suffix (``x.weight`` → ``x.weight_scale_inv``), DeepSeek's own
#: (``x.scale``), and the dtypes the weights (int8 in ``FP8Experts``; uint8 from other writers) and scales arrive in
UE8M0_SCALE, DEEPSEEK_SCALE = "_scale_inv", ".scale"
UE8M0_STORED = ("int8", "uint8")
UE8M0_SCALES = ("float8_e8m0fnu", "uint8")


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


def _packed_per_expert(e: ExpertsLayout, cmap: CheckpointMap, ckpt, stored: tuple[str, ...], dtype, what: str):
    """The experts layout with each weight resolved by `transformers`' rules at its packed shape ``[N, K/2]``
    (``dtype``), with its row segments; None when the checkpoint holds the weights unquantized."""
    weights = [p for p in e.params if p.role is ParamRole.WEIGHT]
    first = [next((m.key for m in cmap.matches(e.full_name(p.name))), None) for p in weights]
    if not any(k is not None and _dtype_name(ckpt, k) in stored for k in first):
        return None
    if e.is_transposed or not e.is_concatenated:
        raise UnsupportedModelError(f"{e.path} ({e.class_name}): {what} experts need [E, out, in] weights with "
                                    f"[gate; up] halves, as their exporters write them (is_transposed="
                                    f"{e.is_transposed}, is_concatenated={e.is_concatenated})")
    packed = [dataclasses.replace(p, expert_shape=(p.expert_shape[0], p.expert_shape[1] // 2), dtype=dtype)
              if p.role is ParamRole.WEIGHT else p for p in e.params]
    resolved = resolve_sources(_one(dataclasses.replace(e, params=tuple(packed))), cmap, ckpt.shape).experts[0]
    out = []
    for p, orig in zip(resolved.params, e.params):
        if p.role is not ParamRole.WEIGHT:
            continue
        src = p.source
        for key in {k for part in src.parts for k in part}:
            if _dtype_name(ckpt, key) not in stored:
                raise CheckpointError(f"{key}: stored as {_dtype_name(ckpt, key)}; {what} experts are "
                                      f"{' or '.join(stored)}")
        if src.kind is SourceKind.PER_EXPERT and src.concat_dim == 0 and len(src.parts) > 1:
            segs = tuple(ckpt.shape(part[0])[0] for part in src.parts)
        else:
            segs = _row_segments(e, orig, orig.expert_shape[0])
        out.append((p, orig, segs))
    return resolved, out


def _nvfp4_experts(e: ExpertsLayout, qc: QuantConfig, cmap: CheckpointMap, ckpt):
    import torch

    found = _packed_per_expert(e, cmap, ckpt, ("uint8",), torch.uint8, "NVFP4")
    if found is None:
        return resolve_sources(_one(e), cmap, ckpt.shape).experts[0], None   # stored unquantized
    resolved, weights = found
    extra, projections = [], []
    for p, orig, segs in weights:
        w, s, s2 = _declared(qc, e, orig, tuple(orig.expert_shape), segs)
        ssrc, s2src = _mirror(p.source, NVFP4_SCALE), _mirror(p.source, NVFP4_SCALE_2)
        _check_scales(ckpt, e, p.source, ssrc, s2src, s, segs)
        extra.append(ExpertParam(s.name, ParamRole.SCALE, s.expert_shape, torch.float8_e4m3fn, ssrc))
        extra.append(ExpertParam(s2.name, ParamRole.SCALE, s2.expert_shape, torch.float32, s2src))
        projections.append(Fp4Projection(p.name, (s.name, s2.name), segs, False))
    return resolved.with_params(*extra), tuple(projections)


def ue8m0_scale_key(ckpt, weight_key: str) -> str:
    """The E8M0 scales of a DeepSeek-V4 weight: ``x.weight_scale_inv`` (`transformers`' name; a fused ``W`` →
    ``W_scale_inv``), else DeepSeek's own ``x.scale``."""
    key = weight_key + UE8M0_SCALE
    native = weight_key.removesuffix(".weight") + DEEPSEEK_SCALE
    return native if key not in ckpt and weight_key.endswith(".weight") and native in ckpt else key


def _ue8m0_experts(e: ExpertsLayout, qc: QuantConfig, cmap: CheckpointMap, ckpt):
    import torch

    found = _packed_per_expert(e, cmap, ckpt, UE8M0_STORED, torch.int8, "DeepSeek-V4 FP4")
    if found is None:
        return resolve_sources(_one(e), cmap, ckpt.shape).experts[0], None
    resolved, weights = found
    extra, projections = [], []
    for p, orig, segs in weights:
        w, s = _declared(qc, e, orig, tuple(orig.expert_shape), segs)
        src = p.source
        ssrc = CheckpointSource(src.kind, tuple(tuple(ue8m0_scale_key(ckpt, k) for k in part) for part in src.parts),
                                concat_dim=src.concat_dim)
        what = f"DeepSeek-V4 FP4 {e.full_name(s.name)}"
        lead = (e.num_experts,) if src.kind is SourceKind.FUSED else ()
        for wpart, spart in zip(src.parts, ssrc.parts):
            for wk, sk in zip(wpart, spart):
                if sk not in ckpt:
                    raise CheckpointError(f"{what}: the checkpoint lacks {sk}")
                rows, half = ckpt.shape(wk)[-2:]
                got = _dtype_name(ckpt, sk)
                _check(ckpt, sk, got if got in UE8M0_SCALES else UE8M0_SCALES[0],
                       (*lead, rows, 2 * half // fp4.MXFP4_GROUP), what)
        scale_dtype = _dtype_name(ckpt, ssrc.parts[0][0])
        extra.append(ExpertParam(s.name, ParamRole.SCALE, s.expert_shape, getattr(torch, scale_dtype), ssrc))
        projections.append(Fp4Projection(p.name, (s.name,), segs, False))
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
    build = {QuantFormat.MXFP4: _mxfp4_experts, QuantFormat.NVFP4: _nvfp4_experts,
             QuantFormat.FP4_UE8M0: _ue8m0_experts}[qc.scheme.format]
    done = [build(e, qc, cmap, ckpt) for e in layout.experts]
    specs = {e.path: Fp4Experts(qc.scheme.format, projections, None) for e, projections in done if projections}
    return layout.replace_experts(e for e, _ in done), specs
