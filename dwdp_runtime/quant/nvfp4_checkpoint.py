"""How an NVFP4 checkpoint stores each quantized linear: its tensors' names and what its global scale means.

Two producers write the same numbers under different names (each row: one linear ``m``, ``[out, in]``):

  =====================  ==========================  ==============================  ============================
  producer               E2M1 codes uint8 [out,in/2]  e4m3 group scales [out, in/16]  fp32 global scale (scalar)
  =====================  ==========================  ==============================  ============================
  NVIDIA ModelOpt        ``m.weight``                 ``m.weight_scale``              ``m.weight_scale_2`` = s2
  compressed-tensors     ``m.weight_packed``          ``m.weight_scale``              ``m.weight_global_scale`` = g
  =====================  ==========================  ==============================  ============================

ModelOpt's ``s2`` multiplies: ``W = e2m1 · s · s2`` (``s2 = amax / (6 · 448)``). compressed-tensors' ``g`` is
its inverse (``g = 6 · 448 / amax``; ``compressed_tensors``' dequantize computes ``e2m1 · (s / g)``), and vLLM
serves it as ModelOpt's format with ``s2 = 1 / g`` in float32 (``CompressedTensorsW4A16Fp4`` /
``…W4A4Nvfp4MoEMethod.process_weights_after_loading``). DWDP does the same: a compressed-tensors checkpoint is
read under ModelOpt's names with ``s2 = fl32(1 / g)`` (``quant.fp4.nvfp4_inverse_global``;
``dwdp_worker.checkpoint.nvfp4_view``), so everything after the read — sharding, prefetch, the dequantized
forward, the GPU kernels — is the ModelOpt path, and the dequantized weight is ``(e2m1 · s) · fl32(1 / g)``.

Activation scales (ModelOpt ``m.input_scale``, compressed-tensors ``m.input_global_scale``) are not named here:
on Hopper the activations stay in the compute dtype (weight-only), so neither is read.

Pure: no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .module_patterns import ModulePatterns


class GlobalScale(str, enum.Enum):
    """What a checkpoint's per-tensor fp32 scale is to the dequantized weight."""

    MULTIPLIER = "multiplier"   # W = e2m1 · s · s2            (ModelOpt's weight_scale_2)
    DIVISOR = "divisor"         # W = e2m1 · s / g = … · (1/g)  (compressed-tensors' weight_global_scale)


class Nvfp4Part(str, enum.Enum):
    """The three stored tensors of one NVFP4 linear."""

    WEIGHT = "weight"               # packed E2M1 codes
    SCALE = "scale"                 # e4m3 scale per 16 input columns
    GLOBAL_SCALE = "global_scale"   # one fp32 per linear


@dataclass(frozen=True)
class Nvfp4Names:
    """One producer's names (the last component of the checkpoint key) and its global-scale convention."""

    producer: str
    weight: str
    scale: str
    global_scale: str
    global_kind: GlobalScale

    def leaf(self, part: Nvfp4Part) -> str:
        return {Nvfp4Part.WEIGHT: self.weight, Nvfp4Part.SCALE: self.scale,
                Nvfp4Part.GLOBAL_SCALE: self.global_scale}[part]

    def part_of(self, leaf: str) -> Nvfp4Part | None:
        """Which NVFP4 tensor a key ending in ``.<leaf>`` is under these names (None: not one of them)."""
        return next((p for p in Nvfp4Part if self.leaf(p) == leaf), None)


MODELOPT_NVFP4 = Nvfp4Names("modelopt", "weight", "weight_scale", "weight_scale_2", GlobalScale.MULTIPLIER)
COMPRESSED_TENSORS_NVFP4 = Nvfp4Names("compressed-tensors", "weight_packed", "weight_scale", "weight_global_scale",
                                      GlobalScale.DIVISOR)


@dataclass(frozen=True)
class Nvfp4Checkpoint:
    """What the loader needs to read an NVFP4 checkpoint besides ``NVFP4_SCHEME``: the producer's names and
    convention, and (compressed-tensors) the modules its config declares unquantized — a quantized tensor of
    one of them is a contradiction the loader refuses."""

    names: Nvfp4Names
    ignore: ModulePatterns = ModulePatterns()
