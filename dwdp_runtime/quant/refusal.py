"""The one refusal of a quantization DWDP cannot serve faithfully, and the list of what it can.

Every parser of a ``quantization_config`` (``config``, ``compressed_tensors``) raises ``refuse(what)``: the
message says what was found and then names everything supported, so a user learns the alternative from the
error itself. Pure: no torch.
"""

from __future__ import annotations

SUPPORTED = ("fp8 block-scaled (quant_method='fp8', fmt='e4m3', activation_scheme='dynamic', "
             "weight_block_size=[128, 128], fp32 weight_scale_inv; or with expert_dtype='fp4', scale_fmt='ue8m0' "
             "as DeepSeek-V4), mxfp4 (quant_method='mxfp4', gpt-oss *_blocks/*_scales experts) and nvfp4 "
             "(quant_method='modelopt', quant_algo='NVFP4', group_size=16; or quant_method='compressed-tensors', "
             "format='nvfp4-pack-quantized' with 4-bit float tensor_group weights of group_size 16, as "
             "llm-compressor's NVFP4A16 / NVFP4 schemes write them)")


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's quantization is not one DWDP can serve faithfully."""


def refuse(what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{what}; DWDP supports unquantized (bf16/fp16/fp32) checkpoints and "
                                        f"{SUPPORTED}")
