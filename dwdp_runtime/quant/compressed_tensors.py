"""A compressed-tensors ``quantization_config`` (what llm-compressor writes) → the NVFP4 checkpoint DWDP
serves, or a refusal naming what is supported.

Accepted — llm-compressor's ``NVFP4A16`` (weight-only) and ``NVFP4`` (W4A4) presets, as ``config.json`` holds
them::

    {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
     "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized"?,
         "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                     "symmetric": true, "dynamic": false, "scale_dtype": "torch.float8_e4m3fn"?, …},
         "input_activations": null | {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                      "group_size": 16, "dynamic": "local" | false, …},
         "output_activations": null}},
     "ignore": ["lm_head", "re:.*mlp.gate$", …], "sparsity_config": {}, "transform_config": {},
     "kv_cache_scheme": null}

Every config group must be NVFP4 (a group's own ``format``, else the top-level one; a top-level
``mixed-precision`` is fine when every group names ``nvfp4-pack-quantized``). ``targets`` say which modules the
producer quantized; the checkpoint's tensors say the same (a module stored with ``weight_packed`` is NVFP4, one
with ``weight`` is not), so the loader goes by the tensors and checks them against ``ignore``.

``input_activations`` (W4A4): the calibrated ``input_global_scale`` and the dynamic per-16 activation scales
are what Blackwell's FP4 × FP4 GEMM consumes. On Hopper DWDP runs weight-only — activations stay in the compute
dtype, as on the ModelOpt path, which ignores its ``input_scale`` for the same reason — so a W4A4 checkpoint is
served with the same weights as its W4A16 twin and its activation scales are not read (the logits are those of
the dequantized-weights model, not of a simulated FP4 activation path). ``kv_cache_scheme`` is not read
either (the KV cache stays in the compute dtype), as ModelOpt's ``kv_cache_quant_algo``.

Refused, each with the field and its value: other formats (``pack-quantized`` int4/int8, ``float-quantized``
fp8, ``naive-quantized``, ``mxfp4-pack-quantized``, ``marlin-24``, …), weights other than 4-bit float
``tensor_group`` of 16 (asymmetric, dynamic, activation-ordered, block-structured, non-e4m3 scales),
activations quantized any other way, output activations, sparsity (``sparsity_config``), online rotations
(``transform_config``), and a ``quantization_status`` other than ``compressed`` (fake-quantized weights).

Pure: no torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from .module_patterns import ModulePatterns
from .nvfp4_checkpoint import COMPRESSED_TENSORS_NVFP4, Nvfp4Checkpoint
from .refusal import refuse
from .scheme import NVFP4_GROUP

#: ``quant_method`` of every compressed-tensors checkpoint
METHOD = "compressed-tensors"
#: the one compression format served: E2M1 codes packed two per byte (``NVFP4PackedCompressor``)
NVFP4_FORMAT = "nvfp4-pack-quantized"
#: the top-level format when config groups carry their own
MIXED_FORMAT = "mixed-precision"
#: the status of a checkpoint whose weights are stored packed (earlier statuses hold fake-quantized floats)
COMPRESSED_STATUS = "compressed"
#: NVFP4 quantization arguments (``compressed_tensors.quantization.QuantizationArgs``): 4-bit floats (E2M1) with
#: one scale per 16 input columns under a per-tensor global scale (``tensor_group``)
NVFP4_ARGS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP}
#: the group-scale dtype NVFP4 stores (``scale_dtype``, absent in older configs)
NVFP4_SCALE_DTYPES = (None, "torch.float8_e4m3fn", "float8_e4m3fn")


def _text(value: Any) -> Any:
    """An enum-valued field as its plain value, strings lower-cased."""
    value = getattr(value, "value", value)
    return value.lower() if isinstance(value, str) else value


def _nvfp4_args(args: Any, where: str, *, weights: bool) -> None:
    """Refuse quantization arguments that are not NVFP4's (``where`` names the group and the field)."""
    if not isinstance(args, Mapping):
        raise refuse(f"{where} {args!r} is not a mapping of quantization arguments")
    for key, want in NVFP4_ARGS.items():
        got = _text(args.get(key))
        if got != want:
            raise refuse(f"{where}.{key} {args.get(key)!r} is not supported (NVFP4 is "
                         f"{', '.join(f'{k}={v!r}' for k, v in NVFP4_ARGS.items())})")
    if args.get("symmetric", True) is not True:
        raise refuse(f"{where}.symmetric {args.get('symmetric')!r} (a zero point) is not supported")
    for key in ("actorder", "block_structure"):
        if args.get(key) not in (None, False):
            raise refuse(f"{where}.{key} {args.get(key)!r} is not supported")
    if weights:
        if args.get("dynamic", False) not in (False, None):
            raise refuse(f"{where}.dynamic {args.get('dynamic')!r} (weights quantized at run time) is not supported")
        scale_dtype = _text(args.get("scale_dtype"))
        if scale_dtype not in NVFP4_SCALE_DTYPES:
            raise refuse(f"{where}.scale_dtype {args.get('scale_dtype')!r} is not supported (NVFP4 group scales "
                         f"are float8_e4m3fn)")


def _check_group(name: str, group: Any, top_format: Any) -> None:
    where = f"compressed-tensors config_groups[{name!r}]"
    if not isinstance(group, Mapping):
        raise refuse(f"{where} {group!r} is not a mapping")
    fmt = _text(group.get("format") or top_format)
    if fmt != NVFP4_FORMAT:
        raise refuse(f"compressed-tensors format {group.get('format') or top_format!r} ({where}) is not supported")
    if group.get("weights") is None:
        raise refuse(f"{where} quantizes no weights (activations only) and is not supported")
    _nvfp4_args(group["weights"], f"{where}.weights", weights=True)
    if group.get("input_activations") is not None:   # W4A4: accepted, served weight-only (module docstring)
        _nvfp4_args(group["input_activations"], f"{where}.input_activations", weights=False)
    if group.get("output_activations") is not None:
        raise refuse(f"{where}.output_activations {group['output_activations']!r} is not supported")


def parse_compressed_tensors(raw: Mapping) -> Nvfp4Checkpoint:
    """A compressed-tensors ``quantization_config`` (dict) → its ``Nvfp4Checkpoint`` (module docstring)."""
    top_format = raw.get("format")
    if _text(top_format) not in (NVFP4_FORMAT, MIXED_FORMAT, None):
        raise refuse(f"compressed-tensors format {top_format!r} is not supported")
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise refuse(f"compressed-tensors config_groups {groups!r}: a config with no quantized group is not "
                     f"supported")
    for name, group in groups.items():
        _check_group(str(name), group, top_format)
    status = _text(raw.get("quantization_status") or COMPRESSED_STATUS)
    if status != COMPRESSED_STATUS:
        raise refuse(f"compressed-tensors quantization_status {raw.get('quantization_status')!r} (weights stored "
                     f"fake-quantized, not packed) is not supported")
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "online transforms")):
        if raw.get(key):
            raise refuse(f"compressed-tensors {key} {raw[key]!r} ({what}) is not supported")
    return Nvfp4Checkpoint(COMPRESSED_TENSORS_NVFP4, ModulePatterns.parse(raw.get("ignore"), "compressed-tensors ignore"))
