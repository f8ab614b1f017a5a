"""FP4 checkpoints on disk: write one from a saved model (MXFP4 as gpt-oss, NVFP4 as ModelOpt), and its
dequantized twin (the reference).

``quantize_checkpoint(dir, fmt)`` rewrites a ``save_pretrained`` directory (``dst``: written there instead,
``dir`` unchanged) the way the released checkpoints are laid out:

  * ``mxfp4`` (openai/gpt-oss-*): every routed experts weight becomes the fused ``<experts>.<W>_blocks``
    uint8 ``[E, out, in/32, 16]`` + ``<W>_scales`` uint8 ``[E, out, in/32]`` (E8M0), the projection as
    ``[out, in]`` whatever the model's parameter layout (gpt-oss's ``gate_up_proj`` is ``[E, in, out]``;
    its interleaved gate/up rows stay in the model's order). Everything else — attention, routers,
    biases, embeddings — stays as saved, and ``quantization_config`` is gpt-oss's (``quant_method: mxfp4``).
  * ``nvfp4`` (nvidia/*-FP4, ModelOpt): every ``nn.Linear`` weight but ``lm_head`` and every routed expert
    projection (``…experts.{e}.{gate,up,down}_proj.weight``, Mixtral ``w1/w3/w2``) becomes ``weight``
    uint8 ``[out, in/2]`` + ``weight_scale`` e4m3 ``[out, in/16]`` + ``weight_scale_2`` fp32 + ``input_scale``
    fp32 (written as ModelOpt does; DWDP does not read it); ``quantization_config`` is ModelOpt's
    (``quant_method: modelopt``, ``quant_algo: NVFP4``, ``group_size: 16``, ``exclude_modules: [lm_head]``).
    NVFP4 needs per-expert ``[out, in]`` projections (a fused, transposed experts tensor is refused).
  * ``fp4-ue8m0`` (deepseek-ai/DeepSeek-V4, as `transformers` 5.24 declares it): every routed expert projection
    becomes ``weight`` int8 ``[out, in/2]`` (E2M1) + ``scale`` E8M0 ``[out, in/32]`` (DeepSeek's own name; the
    loader also reads `transformers`' ``weight_scale_inv``), every other ``nn.Linear`` but ``lm_head`` FP8
    e4m3 with E8M0 128×128 block scales (powers of two rounded up, as ``scale_fmt: ue8m0`` means);
    ``quantization_config`` is ``quant_method: fp8`` with ``scale_fmt: ue8m0``, ``expert_dtype: fp4``.

``dequantize_checkpoint(src, dst)`` writes the reference the FP4 tests compare against: every FP4 tensor
replaced by ``quant.fp4``'s dequantization of it (float32, laid out as the model's parameter, no scale
tensors, no ``quantization_config``): plain `transformers` on it is "the dequantized-weights model".
``config.json`` is written last, so its ``quantization_config`` marks a complete checkpoint.
"""

from __future__ import annotations

import json
import pathlib

from dwdp_runtime.quant import fp4, fp4_config_dict, fp8_block

from .fp4_layout import DEEPSEEK_SCALE, MXFP4_BLOCKS, MXFP4_SCALES, NVFP4_SCALE, NVFP4_SCALE_2, UE8M0_SCALE

#: the FP4 formats ``quantize_checkpoint`` writes
FORMATS = ("mxfp4", "nvfp4", "fp4-ue8m0")
#: ModelOpt's activation-scale suffix; written (as ModelOpt does), not read (weight-only on Hopper)
NVFP4_INPUT_SCALE = "input_scale"
#: gpt-oss's modules_to_not_convert: everything but the routed experts stays unquantized
MXFP4_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")


def _weights(layout):
    from ..model.experts_layout import ParamRole

    for experts in layout.experts:
        for p in experts.params:
            if p.role is ParamRole.WEIGHT:
                yield experts, p


def _mxfp4(tensors, layout) -> dict:
    import torch

    from ..model.experts_layout import SourceKind

    out, done = {}, set()
    for experts, p in _weights(layout):
        src = p.source
        if src.kind is SourceKind.FUSED and not src.slice_ops:
            fused = tensors[src.fused_key]
        elif src.kind is SourceKind.PER_EXPERT:
            fused = torch.stack([torch.cat([tensors[part[e]] for part in src.parts], dim=src.concat_dim)
                                 for e in range(experts.num_experts)])
        else:
            raise ValueError(f"{experts.full_name(p.name)}: synth writes MXFP4 from save_pretrained's layout")
        done.update(k for part in src.parts for k in part)
        w = fused.transpose(-2, -1) if experts.is_transposed else fused   # [E, out, in]
        q, e = fp4.mxfp4_quantize(w)
        key = experts.full_name(p.name)
        out[key + MXFP4_BLOCKS] = q.reshape(*e.shape, -1).contiguous()
        out[key + MXFP4_SCALES] = e
    out.update({k: v for k, v in tensors.items() if k not in done})
    return out


def _nvfp4_one(out: dict, key: str, w) -> None:
    import torch

    q, s, s2 = fp4.nvfp4_quantize(w)
    out[key], out[key + NVFP4_SCALE], out[key + NVFP4_SCALE_2] = q, s, s2.reshape(())
    out[key.removesuffix("weight") + NVFP4_INPUT_SCALE] = torch.ones((), dtype=torch.float32)


def _nvfp4(tensors, layout, linear) -> dict:
    from ..model.experts_layout import SourceKind

    out, done = {}, set()
    for experts, p in _weights(layout):
        src = p.source
        if src.kind is not SourceKind.PER_EXPERT or src.concat_dim != 0 or experts.is_transposed:
            raise ValueError(f"{experts.full_name(p.name)} ({experts.class_name}): NVFP4 needs per-expert [out, in] "
                             f"projections as ModelOpt exports them; this model saves "
                             f"{'transposed' if experts.is_transposed else src.kind.value} experts")
        for part in src.parts:
            for k in part:
                _nvfp4_one(out, k, tensors[k])
                done.add(k)
    for key, value in tensors.items():
        if key in done:
            continue
        if key in linear and value.dim() == 2 and value.shape[-1] % fp4.NVFP4_GROUP == 0:
            _nvfp4_one(out, key, value)
        else:
            out[key] = value
    return out


def _native_scale(key: str) -> str:
    """DeepSeek's own scale name beside a weight: ``x.weight`` → ``x.scale`` (the released V4 checkpoint's)."""
    return key.removesuffix(".weight") + DEEPSEEK_SCALE


def _fp8_ue8m0(w):
    """FP8 e4m3 with power-of-two (E8M0) 128×128 block scales: DeepSeek-V4's dense linears."""
    import torch

    from dwdp_runtime.quant import fp8_block

    _, s32 = fp8_block.quantize(w)                       # amax / 448 per block (1 for an all-zero block)
    exp = torch.ceil(torch.log2(s32))                     # rounded up: no element exceeds 448 · scale
    q = (w.to(torch.float32) / fp8_block.expand_scales(torch.exp2(exp), *w.shape)).clamp(-448, 448)
    return q.to(torch.float8_e4m3fn), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _ue8m0(tensors, layout, linear) -> dict:
    import torch

    from ..model.experts_layout import SourceKind

    out, done = {}, set()
    for experts, p in _weights(layout):
        src = p.source
        if src.kind is not SourceKind.PER_EXPERT or src.concat_dim != 0 or experts.is_transposed:
            raise ValueError(f"{experts.full_name(p.name)} ({experts.class_name}): DeepSeek-V4 FP4 needs per-expert "
                             f"[out, in] projections")
        for part in src.parts:
            for k in part:
                q, e = fp4.mxfp4_quantize(tensors[k])
                out[k], out[_native_scale(k)] = q.view(torch.int8), e.view(torch.float8_e8m0fnu)
                done.add(k)
    for key, value in tensors.items():
        if key in done:
            continue
        if key in linear and value.dim() == 2:
            out[key], out[_native_scale(key)] = _fp8_ue8m0(value)
        else:
            out[key] = value
    return out


def quantize_checkpoint(model_dir, fmt: str, dst=None) -> pathlib.Path:
    """Rewrite ``model_dir`` (written by ``save_pretrained``, unquantized) as an ``fmt`` FP4 checkpoint (module
    docstring), or with ``dst`` write it to ``dst`` and leave ``model_dir`` as it is."""
    from safetensors.torch import load_file, save_file

    from .fp8 import _copy_other_files, _plan

    if fmt not in FORMATS:
        raise ValueError(f"FP4 format {fmt!r}: must be one of {', '.join(FORMATS)}")
    model_dir = pathlib.Path(model_dir)
    out_dir = model_dir if dst is None else pathlib.Path(dst)
    raw = json.loads((model_dir / "config.json").read_text())
    if raw.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized")
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{model_dir}: expected one model.safetensors (synthetic checkpoints are one file)")
    tensors = load_file(str(files[0]))
    linear, layout = _plan(model_dir, tensors)  # the FP8 writer's: nn.Linear keys and the resolved experts layout
    out = (_mxfp4(tensors, layout) if fmt == "mxfp4" else _nvfp4(tensors, layout, linear) if fmt == "nvfp4"
           else _ue8m0(tensors, layout, linear))
    if out_dir != model_dir:
        _copy_other_files(model_dir, out_dir)
    save_file(out, str(out_dir / files[0].name), metadata={"format": "pt"})
    raw["quantization_config"] = fp4_config_dict(fmt, MXFP4_NOT_CONVERTED if fmt == "mxfp4" else ("lm_head",))
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out_dir


def _transposed_experts(src: pathlib.Path) -> set[str]:
    """Experts module paths whose parameters are ``[E, in, out]`` (the model's own layout, discovered)."""
    import torch

    from .loader import build_meta_model, load_config
    from ..model.registry import model_layout

    return {e.path for e in model_layout(build_meta_model(load_config(src), torch.float32)).experts
            if e.is_transposed}


def dequantize_checkpoint(src, dst, *, dtype: str = "float32") -> pathlib.Path:
    """Write the dequantized-weights twin of FP4 checkpoint ``src`` to ``dst`` (see module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    from .fp8 import _copy_other_files

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    transposed = _transposed_experts(src)
    _copy_other_files(src, dst)
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config", None)
    raw["dtype"] = dtype
    want = getattr(torch, dtype)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        out = {}
        for key, value in tensors.items():
            if key.endswith(MXFP4_BLOCKS):
                name = key.removesuffix(MXFP4_BLOCKS)
                w = fp4.mxfp4_dequantize(value, tensors[name + MXFP4_SCALES], want)
                out[name] = (w.transpose(-2, -1) if name.rpartition(".")[0] in transposed else w).contiguous()
            elif value.dtype in (torch.int8, torch.float8_e4m3fn) and _ue8m0_scale(key, tensors) is not None:
                sc = tensors[_ue8m0_scale(key, tensors)]
                out[key] = (fp4.mxfp4_dequantize(value, sc, want) if value.dtype == torch.int8
                            else fp8_block.dequantize(value, sc, want)).contiguous()
            elif value.dtype == torch.uint8 and key + NVFP4_SCALE in tensors:
                out[key] = fp4.nvfp4_dequantize(value, tensors[key + NVFP4_SCALE], tensors[key + NVFP4_SCALE_2],
                                                want).contiguous()
            elif not _is_fp4_extra(key, tensors):
                out[key] = value.contiguous()
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return dst


def _ue8m0_scale(key: str, tensors) -> str | None:
    """The scale key of a DeepSeek-V4 int8 (FP4) or e4m3 weight: ``x.scale`` or ``x.weight_scale_inv``."""
    for k in (_native_scale(key), key + UE8M0_SCALE):
        if k != key and k in tensors:
            return k
    return None


def _is_fp4_extra(key: str, tensors) -> bool:
    """A scale tensor of an FP4 weight (dropped from the twin)."""
    import torch

    def packed(k: str) -> bool:
        return k in tensors and tensors[k].dtype == torch.uint8

    if key.endswith(MXFP4_SCALES) and key.removesuffix(MXFP4_SCALES) + MXFP4_BLOCKS in tensors:
        return True
    for sfx, base in ((DEEPSEEK_SCALE, ".weight"), (UE8M0_SCALE, "")):   # DeepSeek-V4: FP4 / FP8 weight scales
        w = key.removesuffix(sfx) + base
        if key.endswith(sfx) and w in tensors and tensors[w].dtype in (torch.int8, torch.float8_e4m3fn):
            return True
    if any(key.endswith(sfx) and packed(key.removesuffix(sfx)) for sfx in (NVFP4_SCALE_2, NVFP4_SCALE)):
        return True
    return key.endswith("." + NVFP4_INPUT_SCALE) and packed(key.removesuffix(NVFP4_INPUT_SCALE) + "weight")
