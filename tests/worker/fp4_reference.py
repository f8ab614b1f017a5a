"""An FP4 checkpoint writer independent of DWDP's (``dwdp_worker.checkpoint.fp4``): the tests' converter.

From an unquantized ``save_pretrained`` directory it writes two checkpoints that hold **the same weights**:

  * an FP4 one, every routed expert projection (and, for NVFP4, every attention projection) replaced by
    random E2M1 codes and random scales, packed here by hand (two codes per byte, the low nibble first);
  * its float32 twin: the same weights as plain numbers, ``value(code) · scale`` computed here from the
    formats' definitions (OCP MX E2M1 table; MXFP4 ``2^(e − 127)``; NVFP4 ``e4m3 · global``).

The scales are drawn so that every product is a float32 number exactly (MXFP4: powers of two; NVFP4: E4M3
scales of 4 significant bits times a global scale of 5, times E2M1's 2 bits), so the twin needs no
rounding convention at all: a DWDP model on the FP4 checkpoint must equal plain `transformers` on the twin
bitwise, whatever formula the production code uses. Nothing of ``dwdp_runtime.quant`` is imported.

Layouts written (as the released checkpoints): DeepSeek-V4 per-expert int8 codes + E8M0 ``….scale``; MXFP4 as
gpt-oss — fused ``<experts>.<W>_blocks`` ``[E, out, in/32, 16]`` and ``<W>_scales`` ``[E, out, in/32]``, the
model's ``[E, in, out]`` parameter transposed; NVFP4 as ModelOpt — per-expert ``….weight`` ``[out, in/2]``, ``….weight_scale`` e4m3
``[out, in/16]``, ``….weight_scale_2`` and ``….input_scale`` fp32 scalars.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import torch
from safetensors.torch import load_file, save_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GPT_OSS_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
ATTENTION = re.compile(r"\.self_attn\.[a-z_]+_proj\.weight$")


def _pack(codes: torch.Tensor) -> torch.Tensor:
    low, high = codes[..., 0::2], codes[..., 1::2]
    return (low | (high << 4)).to(torch.uint8)


def _copy(src: pathlib.Path, dst: pathlib.Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)


def _write(src, fp4_dir, twin_dir, fp4_tensors, twin_tensors, quantization_config):
    """Both checkpoints (``twin_dir`` None: the FP4 one only); returns their paths."""
    src, fp4_dir = pathlib.Path(src), pathlib.Path(fp4_dir)
    twin_dir = None if twin_dir is None else pathlib.Path(twin_dir)
    raw = json.loads((src / "config.json").read_text())
    for d, tensors, qc in ((fp4_dir, fp4_tensors, quantization_config), (twin_dir, twin_tensors, None)):
        if d is None:
            continue
        _copy(src, d)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = dict(raw, dtype="float32")
        if qc is not None:
            cfg["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return fp4_dir, twin_dir


def write_mxfp4(src, fp4_dir, twin_dir, *, seed: int = 0):
    """gpt-oss MXFP4 from a gpt_oss ``save_pretrained`` directory (experts ``[E, in, out]``)."""
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(pathlib.Path(src) / "model.safetensors"))
    fp4, twin = {}, {}
    for key, value in tensors.items():
        if not GPT_OSS_EXPERTS.search(key):
            fp4[key] = twin[key] = value
            continue
        e, k, n = value.shape                                  # the model's [E, in, out]
        codes = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
        # 2^(byte − 127) around 1/(2·√k): the weights' usual size
        centre = 127 - 1 - int(round(0.5 * torch.log2(torch.tensor(float(k))).item()))
        exps = torch.randint(centre - 1, centre + 2, (e, n, k // 32), generator=g, dtype=torch.uint8)
        fp4[key + "_blocks"] = _pack(codes).reshape(e, n, k // 32, 16)
        fp4[key + "_scales"] = exps
        w = E2M1[codes.long()] * torch.pow(2.0, exps.to(torch.float32) - 127).repeat_interleave(32, dim=-1)
        twin[key] = w.transpose(1, 2)
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
    return _write(src, fp4_dir, twin_dir, fp4, twin, qc)


def write_ue8m0(src, fp4_dir, twin_dir, *, seed: int = 0):
    """DeepSeek-V4 FP4 experts from a deepseek_v4 ``save_pretrained`` directory (its own key names:
    ``….experts.{e}.w1.weight``): int8 codes ``[out, in/2]`` + E8M0 ``….scale`` ``[out, in/32]`` (DeepSeek's name);
    everything else as saved. ``quantization_config`` as `transformers` 5.24 declares DeepSeek-V4's."""
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(pathlib.Path(src) / "model.safetensors"))
    fp4, twin = {}, {}
    for key, value in tensors.items():
        if not PER_EXPERT.search(key):
            fp4[key] = twin[key] = value
            continue
        n, k = value.shape
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        centre = 127 - 1 - int(round(0.5 * torch.log2(torch.tensor(float(k))).item()))
        exps = torch.randint(centre - 1, centre + 2, (n, k // 32), generator=g, dtype=torch.uint8)
        fp4[key] = _pack(codes).view(torch.int8)
        fp4[key.removesuffix(".weight") + ".scale"] = exps.view(torch.float8_e8m0fnu)
        twin[key] = E2M1[codes.long()] * torch.pow(2.0, exps.to(torch.float32) - 127).repeat_interleave(32, dim=-1)
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
          "scale_fmt": "ue8m0", "expert_dtype": "fp4", "modules_to_not_convert": ["lm_head"]}
    return _write(src, fp4_dir, twin_dir, fp4, twin, qc)


def _nvfp4_weight(shape, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8, e4m3 scales, global scale, the exact float weight) of one [out, in] projection."""
    n, k = shape
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    # e4m3 scales (1 + m/8) · 2^j, j ∈ [-2, 1]: four significant bits, exact in float8_e4m3fn
    mant = torch.randint(0, 8, (n, k // 16), generator=g).to(torch.float32)
    scale = (1 + mant / 8) * torch.pow(2.0, torch.randint(-2, 2, (n, k // 16), generator=g).to(torch.float32))
    # a global scale of five significant bits around 1/(4·√k)
    glob = (1 + torch.randint(0, 16, (), generator=g).item() / 16) * 2.0 ** -(2 + round(0.5 * torch.log2(
        torch.tensor(float(k))).item()))
    w = E2M1[codes.long()] * scale.repeat_interleave(16, dim=-1) * glob
    return _pack(codes), scale.to(torch.float8_e4m3fn), torch.tensor(glob, dtype=torch.float32), w


def write_nvfp4(src, fp4_dir, twin_dir, *, seed: int = 0, hf_quant_config_json: bool = False):
    """ModelOpt NVFP4 from a per-expert ``save_pretrained`` directory (qwen3_moe, deepseek_v3, mixtral): the
    routed experts and the attention projections quantized, the rest as saved. ``hf_quant_config_json``:
    the quantization in ``hf_quant_config.json`` (older ModelOpt exports), not in config.json."""
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(pathlib.Path(src) / "model.safetensors"))
    fp4, twin, excluded = {}, {}, ["lm_head"]
    for key, value in sorted(tensors.items()):
        if not (PER_EXPERT.search(key) or ATTENTION.search(key)) or value.shape[-1] % 16:
            fp4[key] = twin[key] = value
            continue
        packed, scale, glob, w = _nvfp4_weight(tuple(value.shape), g)
        base = key.removesuffix("weight")
        fp4[key], fp4[key + "_scale"], fp4[key + "_scale_2"] = packed, scale, glob
        fp4[base + "input_scale"] = torch.tensor(0.125, dtype=torch.float32)
        twin[key] = w if twin_dir is not None else value
    section = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excluded}
    if not hf_quant_config_json:
        return _write(src, fp4_dir, twin_dir, fp4, twin, {"quant_method": "modelopt", **section})
    out = _write(src, fp4_dir, twin_dir, fp4, twin, None)
    (pathlib.Path(fp4_dir) / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": section}))
    return out
