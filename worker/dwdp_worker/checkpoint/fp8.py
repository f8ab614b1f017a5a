"""FP8 block-scaled checkpoints on disk: write one from a saved model, and its dequantized twin (the reference).

``quantize_checkpoint(dir)`` rewrites a ``save_pretrained`` directory (``quantize_checkpoint(src, dst)`` writes
the result to ``dst``, ``src`` unchanged) the way DeepSeek-V3/R1 and Qwen3-*-FP8 are published: every
``nn.Linear`` weight except ``lm_head`` (attention projections, dense MLPs, shared experts) and every routed
expert projection (``…experts.{e}.{gate,up,down}_proj.weight``; Mixtral ``w1/w3/w2``) becomes ``weight``
float8_e4m3fn + ``weight_scale_inv`` float32 ``[⌈out/128⌉, ⌈in/128⌉]``; embeddings, norms, routers (not
``nn.Linear`` in `transformers`, unquantized in the released checkpoints), DeepSeek-V3's score-correction bias and
``lm_head`` stay as they are. ``config.json`` gains the ``quantization_config`` DeepSeek-V3 writes. With
``fused_experts=True`` the experts are stored as the fused tensors `transformers`' ``FP8Experts`` holds:
``experts.gate_up_proj [E, 2I, H]`` + ``experts.gate_up_proj_scale_inv [E, 2⌈I/128⌉, ⌈H/128⌉]`` (gate and up
quantized separately, as in the per-expert checkpoint) and ``experts.down_proj`` + its scale.

``dequantize_checkpoint(src, dst)`` writes the reference every FP8 test compares against: the same directory
with every FP8 tensor replaced by ``fp8_block.dequantize`` of it (float32, no scale tensors, no
``quantization_config``): plain `transformers` on it is "the dequantized-weights model".
"""

from __future__ import annotations

import json
import pathlib
import shutil

from dwdp_runtime.quant import fp8_config_dict
from dwdp_runtime.quant import fp8_block

SCALE_SUFFIX = "_scale_inv"


def scale_key(weight_key: str) -> str:
    """``x.weight`` → ``x.weight_scale_inv``; a fused ``experts.gate_up_proj`` → ``…gate_up_proj_scale_inv``."""
    return weight_key + SCALE_SUFFIX


def _plan(model_dir: pathlib.Path, keys):
    """(checkpoint keys of ``nn.Linear`` weights but ``lm_head``, the resolved experts layout) by `transformers`'
    own loading rules (``checkpoint_names``): the same names the loader reads."""
    import torch

    from .names import CheckpointMap, resolve_sources
    from .loader import build_meta_model, load_config
    from ..model.registry import model_layout

    model = build_meta_model(load_config(model_dir), torch.float32)
    cmap = CheckpointMap.build(model, keys)
    linear = set()
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and name != "lm_head":
            linear.update(m.key for m in cmap.matches(f"{name}.weight"))
    return linear, resolve_sources(model_layout(model), cmap, lambda k: tuple(keys[k].shape))


def quantize_checkpoint(model_dir, dst=None, *, fused_experts: bool = False) -> pathlib.Path:
    """Rewrite ``model_dir`` (written by ``save_pretrained``, unquantized) as an FP8 block-scaled checkpoint, or
    with ``dst`` write that checkpoint to ``dst`` (created; the other files copied) and leave ``model_dir`` as it
    is. ``config.json`` is written last, so its ``quantization_config`` marks a complete checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file

    from ..model.experts_layout import ParamRole, SourceKind

    model_dir = pathlib.Path(model_dir)
    out_dir = model_dir if dst is None else pathlib.Path(dst)
    cfg_path = model_dir / "config.json"
    raw = json.loads(cfg_path.read_text())
    if raw.get("quantization_config"):
        raise ValueError(f"{model_dir} is already quantized")
    files = sorted(model_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{model_dir}: expected one model.safetensors (synthetic checkpoints are one file)")
    tensors = load_file(str(files[0]))
    linear, layout = _plan(model_dir, tensors)
    out = {}
    expert_keys = set()
    for experts in layout.experts:
        for p in experts.params:
            if p.role is not ParamRole.WEIGHT:
                continue
            src = p.source
            if src.kind is not SourceKind.PER_EXPERT or src.concat_dim != 0:
                raise ValueError(f"{experts.full_name(p.name)}: synth quantizes save_pretrained's per-expert layout")
            expert_keys.update(k for part in src.parts for k in part)
            if not fused_experts:  # as the released checkpoints: each per-expert projection quantized
                for part in src.parts:
                    for k in part:
                        out[k], out[scale_key(k)] = fp8_block.quantize(tensors[k])
                continue
            segs = tuple(tensors[part[0]].shape[0] for part in src.parts)
            fused = torch.stack([torch.cat([tensors[part[e]] for part in src.parts]) for e in range(experts.num_experts)])
            key = experts.full_name(p.name)
            out[key], out[scale_key(key)] = fp8_block.quantize(fused, row_segments=segs)
    for key, value in tensors.items():
        if key in expert_keys:
            continue
        if key in linear and value.dim() == 2:
            out[key], out[scale_key(key)] = fp8_block.quantize(value)
        else:
            out[key] = value
    if out_dir != model_dir:
        _copy_other_files(model_dir, out_dir)
    save_file(out, str(out_dir / files[0].name), metadata={"format": "pt"})
    raw["quantization_config"] = fp8_config_dict(("lm_head",))
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return out_dir


def _copy_other_files(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Every file of ``src`` but the weights and ``config.json`` (each writer writes its own) into ``dst``."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)


def dequantize_checkpoint(src, dst, *, dtype: str = "float32") -> pathlib.Path:
    """Write the dequantized-weights twin of FP8 checkpoint ``src`` to ``dst`` (see module docstring)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    _copy_other_files(src, dst)
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config", None)
    raw["dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    want = getattr(torch, dtype)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        out = {}
        for key, value in tensors.items():
            if key.endswith(SCALE_SUFFIX):
                continue
            if value.dtype == torch.float8_e4m3fn:
                s = tensors[scale_key(key)]
                segs = None
                if key.endswith(".gate_up_proj"):  # fused: gate and up were quantized separately
                    segs = (value.shape[-2] // 2, value.shape[-2] // 2)
                value = fp8_block.dequantize(value, s, want, row_segments=segs)
            out[key] = value.contiguous()
        save_file(out, str(dst / f.name), metadata={"format": "pt"})
    return dst


def bind_quantized_experts(model, quant_dir, device, compute_dtype):
    """Give an unsharded model (e.g. ``oracle.Reference`` on the dequantized twin) the quantized experts of
    ``quant_dir`` (FP8, MXFP4 or NVFP4) as plain ``[E, ...]`` device tensors, computing through the same
    quantized experts forward as the engine: the unsharded baseline of ``bench/fp8_prefill.py`` and the GPU
    FP4 tests (same kernels, no DWDP). Returns the ``model.attach`` ``Attachment`` of those forwards (the
    replaced parameters are this reference model's own)."""
    import torch

    from ..model.attach import attach

    from . import quant_loading as quant
    from .names import CheckpointMap
    from .loader import _expert_reader, load_config
    from .nvfp4_view import modelopt_view
    from ..model.registry import model_layout
    from .safetensors_index import SafetensorsIndex

    class _NoBar:
        def update(self, n: int) -> None:
            pass

    qc = quant.quant_config_of(load_config(quant_dir))
    with SafetensorsIndex(quant_dir) as index:
        ckpt = modelopt_view(index, qc)
        layout, quantized = quant.resolve_layout(model_layout(model), qc, CheckpointMap.build(model, ckpt.entries),
                                                 ckpt)
        for experts in layout.experts:
            module = model.get_submodule(experts.path)
            for p in experts.params:
                host = torch.empty((experts.num_experts, *p.expert_shape), dtype=p.dtype)
                _expert_reader(ckpt, experts, p, _NoBar())(host, 0, experts.num_experts)
                module._parameters[p.name] = torch.nn.Parameter(host.to(device), requires_grad=False)
    return attach(model, device=device, experts=None, overrides=quant.overrides(quantized, compute_dtype),
                  fused_layers=False)


#: the FP8 bench's name for it (``bench/fp8_prefill.py``)
bind_fp8_experts = bind_quantized_experts
