"""``quantization_config`` of a checkpoint → the ``QuantScheme`` DWDP serves it with, or a clear refusal.

Accepted:

* FP8 block-scaled (what DeepSeek-V3/R1 and Qwen3-*-FP8 write, and `transformers`' ``FineGrainedFP8Config`` reads)::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...]?, "scale_fmt": "float"?}

  ``fmt`` may be absent (transformers does not write it); ``modules_to_not_convert`` (alias ``ignored_layers``)
  lists modules stored unquantized. With ``"expert_dtype": "fp4", "scale_fmt": "ue8m0"`` (DeepSeek-V4, as
  `transformers` 5.24 declares it) the routed experts are FP4 (int8 ``[N, K/2]`` + E8M0 ``[N, K/32]``) and
  the dense FP8 linears carry E8M0 block scales (dequantized at load).
* MXFP4 (gpt-oss; `transformers`' ``Mxfp4Config``)::

    {"quant_method": "mxfp4", "modules_to_not_convert": [...]?}

  experts as ``W_blocks`` / ``W_scales`` (E8M0 per 32 columns); everything else unquantized.
* NVFP4 (NVIDIA ModelOpt: ``config.json``'s ``quantization_config``, or ``hf_quant_config.json``'s
  ``quantization`` section, which the loader reads into it)::

    {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16?, "exclude_modules": [...]?,
     "kv_cache_quant_algo": null?}

  (the newer form nests ``group_size`` in ``config_groups.*.weights`` and names the exclusions ``ignore``).
  Each quantized linear stores ``weight`` uint8 ``[N, K/2]``, ``weight_scale`` e4m3 ``[N, K/16]``,
  ``weight_scale_2`` fp32 and ``input_scale`` fp32. ``input_scale`` is the calibrated activation scale of
  Blackwell's FP4×FP4 GEMM; on Hopper the activations stay bf16 (weight-only), so it is not read.
* NVFP4 as compressed-tensors writes it (llm-compressor's ``NVFP4A16`` / ``NVFP4`` presets; parsed and
  refused in ``compressed_tensors``)::

    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head", "re:…"]?,
     "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                       "strategy": "tensor_group", "group_size": 16, …}, "input_activations": null | {…}}}}

  The same numbers as ModelOpt's under other names — ``weight_packed``, ``weight_scale`` and
  ``weight_global_scale``, the INVERSE of ModelOpt's ``weight_scale_2`` — so it is the same
  ``NVFP4_SCHEME`` (the same sharded bytes, the planner's ``nvfp4``), with ``QuantConfig.nvfp4`` saying how
  the checkpoint names and scales its tensors (``nvfp4_checkpoint``; the loader reads it under ModelOpt's
  names with ``weight_scale_2 = 1 / weight_global_scale``, as vLLM does). W4A4 (``input_activations``) is
  served weight-only, its activation scales not read, exactly as ModelOpt's ``input_scale``.

Everything else is refused with ``UnsupportedQuantizationError`` naming what is supported (``SUPPORTED``):
other methods (gptq, awq, …), static activation scales (they need a calibrated per-tensor input scale our
kernels do not apply), FP8 block sizes other than 128×128 (the kernels tile by 128), e5m2 weights, ue8m0
scales on FP8 experts, fp4 experts with float scales, ModelOpt algorithms other than NVFP4, NVFP4 groups other
than 16, and compressed-tensors formats and schemes other than NVFP4 (int4 ``pack-quantized``, fp8
``float-quantized``, sparsity, transforms, …).

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from . import compressed_tensors
from .nvfp4_checkpoint import MODELOPT_NVFP4, Nvfp4Checkpoint
from .refusal import SUPPORTED, UnsupportedQuantizationError, refuse as _refuse
from .scheme import (FP4_UE8M0_SCHEME, FP8_BLOCK, FP8_BLOCK_SCHEME, MXFP4_SCHEME, NVFP4_GROUP, NVFP4_SCHEME,
                     UNQUANTIZED, QuantScheme)


@dataclass(frozen=True)
class QuantConfig:
    """A parsed, accepted quantization config."""

    scheme: QuantScheme
    modules_to_not_convert: tuple[str, ...] = ()
    #: NVFP4 only: how the checkpoint names and scales each linear's tensors (ModelOpt's or compressed-tensors')
    nvfp4: Nvfp4Checkpoint | None = None

    @property
    def quantized(self) -> bool:
        return self.scheme.quantized


NONE = QuantConfig(UNQUANTIZED)


def as_dict(qc: Any) -> dict:
    if qc is None:
        return {}
    if isinstance(qc, Mapping):
        return dict(qc)
    to_dict = getattr(qc, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    raise UnsupportedQuantizationError(f"quantization_config {qc!r} is neither a mapping nor a config object")


def _text(value: Any) -> str:
    """A config value as lower-case text (transformers stores ``quant_method`` as a str-valued enum)."""
    return str(getattr(value, "value", value)).lower()


def _module_list(raw: dict, *keys: str) -> tuple[str, ...]:
    for key in keys:
        skip = raw.get(key)
        if skip:
            if isinstance(skip, str) or not all(isinstance(x, str) for x in skip):
                raise _refuse(f"{key} {skip!r} must be a list of module names")
            return tuple(skip)
    return ()


def parse_quantization_config(qc: Any) -> QuantConfig:
    """``config.quantization_config`` (dict, `transformers` config object or None) → ``QuantConfig``."""
    raw = as_dict(qc)
    if not raw:
        return NONE
    method = _text(raw.get("quant_method", ""))
    if method == "mxfp4":
        return _parse_mxfp4(raw)
    if method == "modelopt":
        return _parse_modelopt(raw)
    if method == compressed_tensors.METHOD:
        ct = compressed_tensors.parse_compressed_tensors(raw)
        return QuantConfig(NVFP4_SCHEME, ct.ignore.entries, ct)
    if method != "fp8":
        raise _refuse(f"quantization method {_text(raw.get('quant_method'))!r} is not supported")
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise _refuse(f"fp8 format {raw.get('fmt')!r} is not supported")
    _check_dynamic(raw)
    block = raw.get("weight_block_size")
    if block is None:
        raise _refuse("per-tensor fp8 (no weight_block_size) is not supported")
    try:
        block_t = tuple(int(b) for b in block)
    except (TypeError, ValueError):
        raise _refuse(f"weight_block_size {block!r} is not a pair of integers") from None
    if block_t != FP8_BLOCK:
        raise _refuse(f"weight_block_size {list(block_t)} is not supported")
    skip = _module_list(raw, "modules_to_not_convert", "ignored_layers")
    scale_fmt, expert = str(raw.get("scale_fmt") or "float").lower(), str(raw.get("expert_dtype") or "fp8").lower()
    if expert == "fp4" and scale_fmt == "ue8m0":
        return QuantConfig(FP4_UE8M0_SCHEME, skip)   # DeepSeek-V4: FP4 experts, FP8 dense (dequantized at load)
    if expert == "fp4":
        raise _refuse(f"expert_dtype 'fp4' with scale_fmt {raw.get('scale_fmt')!r} (DeepSeek-V4 ships 'ue8m0') "
                      f"is not supported")
    if scale_fmt != "float":
        raise _refuse(f"scale_fmt {raw.get('scale_fmt')!r} with FP8 experts is not supported")
    if expert != "fp8":
        raise _refuse(f"expert_dtype {raw.get('expert_dtype')!r} is not supported")
    return QuantConfig(FP8_BLOCK_SCHEME, skip)


def _check_dynamic(raw: dict) -> None:
    act = str(raw.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        raise _refuse(f"activation_scheme {raw.get('activation_scheme')!r} (static activation scales) is not supported")


def _parse_mxfp4(raw: dict) -> QuantConfig:
    _check_dynamic(raw)
    return QuantConfig(MXFP4_SCHEME, _module_list(raw, "modules_to_not_convert"))


def _modelopt_group(raw: dict) -> Any:
    """ModelOpt's weight group size: top level (``hf_quant_config.json``) or per config group (newer exports)."""
    groups = {g.get("weights", {}).get("group_size") for g in (raw.get("config_groups") or {}).values()
              if isinstance(g, Mapping) and isinstance(g.get("weights"), Mapping)} - {None}
    if len(groups) > 1:
        raise _refuse(f"modelopt config groups with different weight group sizes {sorted(groups)} are not supported")
    return raw.get("group_size", groups.pop() if groups else NVFP4_GROUP)


def _parse_modelopt(raw: dict) -> QuantConfig:
    algo = str(raw.get("quant_algo") or "").upper()
    if algo != "NVFP4":
        raise _refuse(f"modelopt quant_algo {raw.get('quant_algo')!r} is not supported")
    group = _modelopt_group(raw)
    if group != NVFP4_GROUP:
        raise _refuse(f"NVFP4 group_size {group!r} is not supported")
    return QuantConfig(NVFP4_SCHEME, _module_list(raw, "exclude_modules", "ignore", "modules_to_not_convert"),
                       Nvfp4Checkpoint(MODELOPT_NVFP4))


def modelopt_config_from_hf_quant(hf_quant: Mapping) -> dict:
    """``hf_quant_config.json`` (ModelOpt's ``{"producer": …, "quantization": {…}}``) → the
    ``quantization_config`` it stands for (``quant_method: modelopt``), as vLLM and SGLang read it."""
    section = hf_quant.get("quantization")
    if not isinstance(section, Mapping):
        raise _refuse("hf_quant_config.json has no 'quantization' section")
    return {"quant_method": "modelopt", **dict(section)}


def fp8_config_dict(modules_to_not_convert: tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` a DWDP FP8 checkpoint carries (as DeepSeek-V3 writes it)."""
    out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    if modules_to_not_convert:
        out["modules_to_not_convert"] = list(modules_to_not_convert)
    return out


def fp4_config_dict(fmt: str, modules_to_not_convert: tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` a DWDP FP4 checkpoint carries: gpt-oss's (``mxfp4``), ModelOpt's (``nvfp4``) or
    DeepSeek-V4's (``fp4-ue8m0``)."""
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": list(modules_to_not_convert)}
    if fmt == "fp4-ue8m0":
        out = fp8_config_dict(modules_to_not_convert)
        return {**out, "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    if fmt == "nvfp4":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": NVFP4_GROUP,
                "kv_cache_quant_algo": None, "exclude_modules": list(modules_to_not_convert)}
    raise ValueError(f"FP4 format {fmt!r}: mxfp4, nvfp4 or fp4-ue8m0")
