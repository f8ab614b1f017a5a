"""Quantization schemes: which per-expert tensors DWDP shards for each checkpoint format (one declaration each).

Pure (no torch): every rank, the loader, the planner and the operator's memory check read the same
declaration, so they agree on what a rank holds.

A fused experts parameter ``W [E, N, K]`` (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) becomes one or
more **sharded** DWDP tensors: each is a composite ``[E, ...]`` whose experts ``[a, b)`` live in this rank's
transport handle and the rest in pool pages (``layout.composite_layout``). Everything else of the model is
**replicated** on every rank: the router (it scores all E experts for every token), DeepSeek-V3's
``e_score_correction_bias``, shared experts, attention and dense MLPs (``REPLICATED`` says how each is held).

Schemes:
  * ``UNQUANTIZED`` (bf16/fp16/fp32 checkpoints): one sharded tensor per parameter, the parameter itself.
  * ``FP8_BLOCK`` (DeepSeek-V3/R1, Qwen3-*-FP8: ``quant_method: fp8``, e4m3, 128×128 blocks, dynamic activations):
      - ``W``           float8_e4m3fn ``[E, N, K]``                            — sharded
      - ``W_scale_inv`` float32       ``[E, Σ⌈n_i/128⌉, ⌈K/128⌉]``            — sharded, like its weight
    where ``n_i`` are the output rows of the projections fused into ``W`` (``gate_up = cat(gate, up)``: the
    checkpoint quantizes ``gate`` and ``up`` separately, so ``gate_up``'s scale rows are ``cat`` of theirs —
    ``2⌈I/128⌉`` rows, which equals ``⌈2I/128⌉`` whenever ``I % 128 == 0`` as in every released model).
    Scale tensors are small (DeepSeek-V3 gate_up: 32×56×4 B = 7 KiB per expert) and not page multiples;
    the composite layout handles any expert size (a local handle rounds up to the granularity, the head of
    the next expert may sit in its padded tail and is filled once at setup, see ``layout``).

  * ``MXFP4`` (gpt-oss: ``quant_method: mxfp4``; E2M1 with an E8M0 exponent per 32 columns, ``quant.fp4``):
      - ``W``         uint8 ``[E, N, K/32, 16]`` (the checkpoint's ``W_blocks``: two E2M1 per byte)  — sharded
      - ``W_scales``  uint8 ``[E, N, K/32]``     (the checkpoint's ``W_scales``, E8M0)              — sharded
  * ``NVFP4`` (ModelOpt ``quant_algo: NVFP4``; E2M1 with an E4M3 scale per 16 columns and an fp32 global):
      - ``W``                uint8         ``[E, N, K/2]``                                            — sharded
      - ``W_weight_scale``   float8_e4m3fn ``[E, N, K/16]``                                           — sharded
      - ``W_weight_scale_2`` float32       ``[E, S]``: one global scale per fused projection (gate, up) — sharded
  * ``FP4_UE8M0`` (DeepSeek-V4: ``quant_method: fp8`` with ``expert_dtype: fp4``, ``scale_fmt: ue8m0``, as
    `transformers` 5.24's ``FP8Experts`` declares it): MXFP4's math (E2M1, an E8M0 exponent per 32 columns)
      - ``W``           int8           ``[E, N, K/2]``  (per expert ``….weight``)                       — sharded
      - ``W_scale_inv`` float8_e8m0fnu ``[E, N, K/32]`` (``….weight_scale_inv``, DeepSeek's ``….scale``) — sharded
  Here ``[N, K]`` is the projection as ``[out, in]`` whatever the model's parameter layout (gpt-oss holds
  ``gate_up_proj`` transposed, ``[in, out]``; its checkpoint blocks are ``[out, in/32, 16]``). FP4 experts
  stay packed through sharding, prefetch and binding: the page pool holds these bytes (¼ of bf16).

Invariant: ``expert_tensors`` returns the weight first and its scales after it, in a fixed order — the order in
which every rank registers them with the transport (allocation i of rank r is the same tensor everywhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: the FP8 scale block: 128×128 weight blocks and 1×128 activation groups (DeepSeek-V3 report §3.3 and every released
#: fine-grained FP8 checkpoint); the FP8 kernels tile K by it (one scale promotion per 128-deep K step) and W4A8
#: re-encodes FP4 experts into it
FP8_SCALE_BLOCK = 128
FP8_BLOCK = (FP8_SCALE_BLOCK, FP8_SCALE_BLOCK)
#: float8_e4m3fn's largest finite value (S.1111.110 = 1.75 · 2^8; ``torch.finfo(torch.float8_e4m3fn).max``): a scale
#: maps a block's or group's amax onto it
E4M3_MAX = 448.0


class TensorRole(str, enum.Enum):
    WEIGHT = "weight"
    SCALE = "scale"


@dataclass(frozen=True)
class ExpertTensor:
    """One sharded per-expert tensor of a fused experts parameter."""

    name: str                    # attribute on the experts module, e.g. "gate_up_proj_scale_inv"
    role: TensorRole
    dtype: str | None            # torch dtype name; None = the model's compute dtype
    expert_shape: tuple[int, ...]
    ckpt_suffix: str             # per-expert checkpoint key suffix: "weight" or "weight_scale_inv"
    #: output rows of the projections fused into the parameter (gate_up: (I, I)); scales are per segment
    row_segments: tuple[int, ...]

    def expert_bytes(self, compute_itemsize: int) -> int:
        n = 1
        for d in self.expert_shape:
            n *= d
        return n * (compute_itemsize if self.dtype is None else DTYPE_BYTES[self.dtype])


DTYPE_BYTES = {"float8_e4m3fn": 1, "float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1,
               "float8_e8m0fnu": 1}


def ceil_div(x: int, m: int) -> int:
    return -(-x // m)


class QuantFormat(str, enum.Enum):
    """How a checkpoint stores its expert weights (one ``QuantScheme`` each)."""

    NONE = "none"
    FP8_BLOCK = "fp8-block"
    MXFP4 = "mxfp4"
    NVFP4 = "nvfp4"
    FP4_UE8M0 = "fp4-ue8m0"   # DeepSeek-V4's experts: MXFP4's math in FP8Experts' containers


#: FP4 group sizes (elements per scale along K): OCP MX (MXFP4) and NVIDIA's NVFP4 micro-block
MXFP4_GROUP = 32
NVFP4_GROUP = 16
#: E2M1 codes per byte
FP4_PER_BYTE = 2


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint format stores the experts: the sharded tensors per fused parameter."""

    name: str
    block: tuple[int, int] | None = None   # (rows, cols) of one scale block; None = unquantized
    format: QuantFormat = QuantFormat.NONE

    @property
    def quantized(self) -> bool:
        return self.block is not None

    @property
    def is_fp4(self) -> bool:
        return self.format in (QuantFormat.MXFP4, QuantFormat.NVFP4, QuantFormat.FP4_UE8M0)

    def expert_tensors(self, param: str, expert_shape: tuple[int, int],
                       row_segments: tuple[int, ...] | None = None) -> tuple[ExpertTensor, ...]:
        """The sharded tensors of fused parameter ``param`` (per-expert ``[N, K]`` = [out, in]), weight first."""
        n, k = expert_shape
        segments = tuple(row_segments) if row_segments else (n,)
        if sum(segments) != n:
            raise ValueError(f"{param}: row segments {segments} do not add up to {n} rows")
        if not self.quantized:
            return (ExpertTensor(param, TensorRole.WEIGHT, None, (n, k), "weight", segments),)
        bn, bk = self.block
        if self.is_fp4 and k % bk:
            raise ValueError(f"{param}: {k} input columns are not a whole number of {bk}-element "
                             f"{self.format.value} groups")
        if self.format is QuantFormat.MXFP4:
            return (ExpertTensor(param, TensorRole.WEIGHT, "uint8", (n, k // bk, bk // FP4_PER_BYTE), "blocks",
                                 segments),
                    ExpertTensor(f"{param}_scales", TensorRole.SCALE, "uint8", (n, k // bk), "scales", segments))
        if self.format is QuantFormat.FP4_UE8M0:
            return (ExpertTensor(param, TensorRole.WEIGHT, "int8", (n, k // FP4_PER_BYTE), "weight", segments),
                    ExpertTensor(f"{param}_scale_inv", TensorRole.SCALE, "float8_e8m0fnu", (n, k // bk),
                                 "weight_scale_inv", segments))
        if self.format is QuantFormat.NVFP4:
            return (ExpertTensor(param, TensorRole.WEIGHT, "uint8", (n, k // FP4_PER_BYTE), "weight", segments),
                    ExpertTensor(f"{param}_weight_scale", TensorRole.SCALE, "float8_e4m3fn", (n, k // bk),
                                 "weight_scale", segments),
                    ExpertTensor(f"{param}_weight_scale_2", TensorRole.SCALE, "float32", (len(segments),),
                                 "weight_scale_2", segments))
        scale_rows = sum(ceil_div(s, bn) for s in segments)
        return (ExpertTensor(param, TensorRole.WEIGHT, "float8_e4m3fn", (n, k), "weight", segments),
                ExpertTensor(f"{param}_scale_inv", TensorRole.SCALE, "float32", (scale_rows, ceil_div(k, bk)),
                             "weight_scale_inv", segments))


UNQUANTIZED = QuantScheme("none")
FP8_BLOCK_SCHEME = QuantScheme("fp8-block", FP8_BLOCK, QuantFormat.FP8_BLOCK)
MXFP4_SCHEME = QuantScheme("mxfp4", (1, MXFP4_GROUP), QuantFormat.MXFP4)
NVFP4_SCHEME = QuantScheme("nvfp4", (1, NVFP4_GROUP), QuantFormat.NVFP4)
FP4_UE8M0_SCHEME = QuantScheme("fp4-ue8m0", (1, MXFP4_GROUP), QuantFormat.FP4_UE8M0)

#: what every rank holds in full, and in which form (docs/MODELS.md; the loader follows it)
REPLICATED: dict[str, str] = {
    "router (gate.weight)": "replicated, checkpoint dtype (never quantized in released FP8/FP4 checkpoints)",
    "e_score_correction_bias": "replicated, float32",
    "shared experts, attention, dense MLPs": "replicated; FP8 and NVFP4 ones dequantized to the compute dtype at load",
    "embeddings, lm_head, norms": "replicated, unquantized in the checkpoint",
}
