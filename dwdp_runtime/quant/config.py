"""``quantization_config`` of a checkpoint → the ``QuantScheme`` DWDP serves it with, or a clear refusal.

Accepted (what DeepSeek-V3/R1 and Qwen3-*-FP8 write, and what `transformers`' ``FineGrainedFP8Config`` reads)::

    {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
     "modules_to_not_convert": [...]?, "scale_fmt": "float"?}

``fmt`` may be absent (transformers does not write it); ``modules_to_not_convert`` (alias ``ignored_layers``)
lists modules stored unquantized. Everything else is refused with ``UnsupportedQuantizationError`` naming what
is supported: other methods (gptq, awq, mxfp4, compressed-tensors, …), static activation scales (they need a
calibrated per-tensor input scale our kernels do not apply), block sizes other than 128×128 (the kernels tile
by 128), e5m2 weights, ue8m0 scales and fp4 experts (DeepSeek-V4 style).

Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .scheme import FP8_BLOCK, FP8_BLOCK_SCHEME, UNQUANTIZED, QuantScheme

SUPPORTED = ("fp8 block-scaled (quant_method='fp8', fmt='e4m3', activation_scheme='dynamic', "
             "weight_block_size=[128, 128], fp32 weight_scale_inv)")


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's quantization is not one DWDP can serve faithfully."""


@dataclass(frozen=True)
class QuantConfig:
    """A parsed, accepted quantization config."""

    scheme: QuantScheme
    modules_to_not_convert: tuple[str, ...] = ()

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


def _refuse(what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{what}; DWDP supports unquantized (bf16/fp16/fp32) checkpoints and "
                                        f"{SUPPORTED}")


def parse_quantization_config(qc: Any) -> QuantConfig:
    """``config.quantization_config`` (dict, `transformers` config object or None) → ``QuantConfig``."""
    raw = as_dict(qc)
    if not raw:
        return NONE
    method = _text(raw.get("quant_method", ""))
    if method != "fp8":
        raise _refuse(f"quantization method {_text(raw.get('quant_method'))!r} is not supported")
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise _refuse(f"fp8 format {raw.get('fmt')!r} is not supported")
    act = str(raw.get("activation_scheme", "dynamic")).lower()
    if act != "dynamic":
        raise _refuse(f"activation_scheme {raw.get('activation_scheme')!r} (static activation scales) is not supported")
    block = raw.get("weight_block_size")
    if block is None:
        raise _refuse("per-tensor fp8 (no weight_block_size) is not supported")
    try:
        block_t = tuple(int(b) for b in block)
    except (TypeError, ValueError):
        raise _refuse(f"weight_block_size {block!r} is not a pair of integers") from None
    if block_t != FP8_BLOCK:
        raise _refuse(f"weight_block_size {list(block_t)} is not supported")
    if str(raw.get("scale_fmt") or "float").lower() != "float":
        raise _refuse(f"scale_fmt {raw.get('scale_fmt')!r} is not supported")
    if str(raw.get("expert_dtype") or "fp8").lower() != "fp8":
        raise _refuse(f"expert_dtype {raw.get('expert_dtype')!r} is not supported")
    skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or ()
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise _refuse(f"modules_to_not_convert {skip!r} must be a list of module names")
    return QuantConfig(FP8_BLOCK_SCHEME, tuple(skip))


def fp8_config_dict(modules_to_not_convert: tuple[str, ...] = ()) -> dict:
    """The ``quantization_config`` a DWDP FP8 checkpoint carries (as DeepSeek-V3 writes it)."""
    out = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
    if modules_to_not_convert:
        out["modules_to_not_convert"] = list(modules_to_not_convert)
    return out
