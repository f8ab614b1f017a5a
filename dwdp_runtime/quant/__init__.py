"""Quantized experts are more DWDP weights: one declaration per checkpoint format of what is sharded.

  scheme     ``QuantScheme`` / ``ExpertTensor``: per fused experts parameter, the sharded tensors (FP8: the e4m3
             weight and its fp32 ``weight_scale_inv``), and ``REPLICATED`` (router, bias, dense)
  config     ``parse_quantization_config``: a checkpoint's ``quantization_config`` → scheme, or a refusal
             (``refusal``: the error and ``SUPPORTED``; ``compressed_tensors``: llm-compressor's NVFP4 configs)
  nvfp4_checkpoint  how an NVFP4 checkpoint names and scales its tensors: ModelOpt's and compressed-tensors'
  module_patterns   compressed-tensors' ``targets`` / ``ignore`` entries (names, ``re:`` patterns)
  fp8_block  quantize / dequantize with 128×128 block scales (torch, imported lazily)
  fp4        E2M1 pack/unpack; MXFP4 and NVFP4 quantize / dequantize (torch, imported lazily)
  memory     ``expert_memory``: bytes per rank by part (weights, scales, pool) from the runtime's own layout

Everything here but ``fp8_block`` and ``fp4`` is pure and imports without torch.
"""

from .config import (NONE, SUPPORTED, QuantConfig, UnsupportedQuantizationError, fp4_config_dict, fp8_config_dict,
                     modelopt_config_from_hf_quant, parse_quantization_config)
from .memory import ExpertMemory, expert_memory, layer_tensors, layers_memory, w4a8_scratch_bytes
from .module_patterns import ModulePatterns
from .nvfp4_checkpoint import (COMPRESSED_TENSORS_NVFP4, MODELOPT_NVFP4, GlobalScale, Nvfp4Checkpoint, Nvfp4Names,
                               Nvfp4Part)
from .scheme import (FP4_UE8M0_SCHEME, FP8_BLOCK, FP8_BLOCK_SCHEME, MXFP4_SCHEME, NVFP4_SCHEME, REPLICATED,
                     UNQUANTIZED, ExpertTensor, QuantFormat, QuantScheme, TensorRole)

__all__ = ["NONE", "SUPPORTED", "QuantConfig", "UnsupportedQuantizationError", "fp4_config_dict", "fp8_config_dict",
           "modelopt_config_from_hf_quant", "parse_quantization_config", "ExpertMemory", "expert_memory",
           "layer_tensors", "layers_memory", "w4a8_scratch_bytes", "FP4_UE8M0_SCHEME", "FP8_BLOCK", "FP8_BLOCK_SCHEME", "MXFP4_SCHEME",
           "NVFP4_SCHEME", "REPLICATED", "UNQUANTIZED", "ExpertTensor", "QuantFormat", "QuantScheme", "TensorRole",
           "ModulePatterns", "COMPRESSED_TENSORS_NVFP4", "MODELOPT_NVFP4", "GlobalScale", "Nvfp4Checkpoint",
           "Nvfp4Names", "Nvfp4Part"]
