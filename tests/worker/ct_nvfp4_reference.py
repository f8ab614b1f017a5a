"""A compressed-tensors NVFP4 checkpoint writer independent of DWDP: numpy bit-twiddling, no project code.

From an unquantized ``save_pretrained`` directory (qwen3_moe, deepseek_v3, mixtral: per-expert ``[out, in]``
projections) it writes up to three checkpoints that hold **the same weights**:

  * compressed-tensors NVFP4, as llm-compressor's ``NVFP4A16`` (or, ``w4a4=True``, ``NVFP4``) preset saves it:
    every ``Linear`` weight not in ``ignore`` becomes ``m.weight_packed`` uint8 ``[out, in/2]`` (two E2M1 codes
    per byte, **element 2j in the low nibble**, as ``compressed_tensors``' ``pack_fp4_to_uint8``),
    ``m.weight_scale`` float8_e4m3fn ``[out, in/16]`` and ``m.weight_global_scale`` float32 ``[1]`` — the
    INVERSE global scale ``g``; W4A4 adds ``m.input_global_scale`` float32 ``[1]``;
  * optionally (``modelopt_dir``) the same codes and group scales in ModelOpt's form, ``weight_scale_2 =
    fl32(1 / g)`` (vLLM's conversion of ``g``): DWDP must serve both bitwise alike;
  * the float32 twin: the weights as plain numbers, ``(e2m1 · s) · fl32(1 / g)`` computed here in float64 (the
    E2M1 × E4M3 product is exact; × a float32 has at most 30 significant bits, exact in float64), then
    rounded once to float32.

The numbers are random and chosen to be representable, not quantized from the original weights: codes
uniform over all 16, e4m3 scales ``(1 + m/8) · 2^j`` (``j`` ∈ [-2, 1]) built bit by bit (exponent field
``j + 7``, three mantissa bits), ``g`` with five significant bits around ``4 · √in`` so that ``1 / g`` is not
a power of two (its rounding is part of what is tested). Modules ignored: ``lm_head``, every router
(``re:`` patterns), one attention projection by exact name, and any linear whose in-features are not whole
16-groups (llm-compressor could not quantize it; named exactly, as it would be). Embeddings are not Linear.
The modules' ``re:`` patterns are matched here with ``re.match``, compressed-tensors' rule.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

#: E2M1 values of codes 0..15 (OCP MX table): magnitudes of 0..7, then the same negated
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
GROUP = 16
#: float8_e4m3fn exponent bias
E4M3_BIAS = 7
#: routers stay unquantized in every llm-compressor recipe; one attention projection ignored by exact name
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:.*block_sparse_moe\.gate$", "model.layers.0.self_attn.o_proj"]
NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": GROUP, "symmetric": True,
              "dynamic": False, "actorder": None, "block_structure": None, "observer": "static_minmax",
              "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}


def ignored(module: str, ignore) -> str | None:
    for entry in ignore:
        if (re.match(entry[3:], module) if entry.startswith("re:") else entry == module):
            return entry
    return None


def ct_config(ignore, *, w4a4: bool) -> dict:
    """``quantization_config`` as llm-compressor 0.8 writes an NVFP4A16 / NVFP4 model's."""
    acts = dict(NVFP4_ARGS, dynamic="local", observer="minmax", scale_dtype=None) if w4a4 else None
    return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None, "kv_cache_scheme": None,
            "sparsity_config": {}, "transform_config": {}, "version": "0.12.2", "ignore": list(ignore),
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": dict(NVFP4_ARGS), "input_activations": acts,
                                          "output_activations": None}}}


def _linear(key: str, value) -> bool:
    return key.endswith(".weight") and value.dim() == 2 and not key.endswith("embed_tokens.weight")


def _one(rng, n: int, k: int):
    """(packed uint8, e4m3 bytes, g, the float32 twin) of one [n, k] projection."""
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    mant = rng.integers(0, 8, size=(n, k // GROUP), dtype=np.uint8)
    exp = rng.integers(-2, 2, size=(n, k // GROUP))
    scale_bytes = (((exp + E4M3_BIAS).astype(np.uint8) << 3) | mant).astype(np.uint8)
    scale = (1.0 + mant / 8.0) * np.exp2(exp)
    g = np.float32((1 + rng.integers(0, 16) / 16) * 2.0 ** (2 + round(0.5 * np.log2(k))))
    s2 = np.float32(1.0 / np.float64(g))
    w = (E2M1[codes] * np.repeat(scale, GROUP, axis=1) * np.float64(s2)).astype(np.float32)
    return packed, scale_bytes, g, s2, w


def _e4m3(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw)).view(torch.float8_e4m3fn)


def _save(src: pathlib.Path, dst: pathlib.Path, tensors: dict, qc: dict | None) -> pathlib.Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = dict(json.loads((src / "config.json").read_text()), dtype="float32")
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def write_ct_nvfp4(src, ct_dir, twin_dir, *, seed: int, modelopt_dir=None, w4a4: bool = False,
                   ignore=IGNORE) -> dict:
    """Write the checkpoints (module docstring); returns ``{"ct", "twin", "modelopt"?, "ignore", "quantized"}``."""
    src = pathlib.Path(src)
    rng = np.random.default_rng(seed)
    tensors = load_file(str(src / "model.safetensors"))
    ignore = list(ignore)
    ct, mo, twin, quantized = {}, {}, {}, []
    for key, value in sorted(tensors.items()):
        module = key.removesuffix(".weight")
        if not _linear(key, value) or ignored(module, ignore):
            ct[key] = mo[key] = twin[key] = value
            continue
        n, k = value.shape
        if k % GROUP:   # llm-compressor cannot quantize it: the recipe names it
            ignore.append(module)
            ct[key] = mo[key] = twin[key] = value
            continue
        packed, scale_bytes, g, s2, w = _one(rng, n, k)
        ct[f"{module}.weight_packed"] = mo[f"{module}.weight"] = torch.from_numpy(packed)
        ct[f"{module}.weight_scale"] = mo[f"{module}.weight_scale"] = _e4m3(scale_bytes)
        ct[f"{module}.weight_global_scale"] = torch.tensor([g], dtype=torch.float32)
        mo[f"{module}.weight_scale_2"] = torch.tensor(s2, dtype=torch.float32)
        if w4a4:
            ct[f"{module}.input_global_scale"] = torch.tensor([448.0 * 6 / 4], dtype=torch.float32)
        mo[f"{module}.input_scale"] = torch.tensor(4 / (448.0 * 6), dtype=torch.float32)
        twin[key] = torch.from_numpy(w)
        quantized.append(module)
    out = {"ct": _save(src, pathlib.Path(ct_dir), ct, ct_config(ignore, w4a4=w4a4)), "ignore": ignore,
           "quantized": quantized}
    if twin_dir is not None:
        out["twin"] = _save(src, pathlib.Path(twin_dir), twin, None)
    if modelopt_dir is not None:
        out["modelopt"] = _save(src, pathlib.Path(modelopt_dir), mo, {
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": GROUP, "kv_cache_quant_algo": None,
            "exclude_modules": ignore})
    return out
