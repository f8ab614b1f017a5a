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

Invariant: ``expert_tensors`` returns the weight first and its scale second, in a fixed order — the order in
which every rank registers them with the transport (allocation i of rank r is the same tensor everywhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: DeepSeek-V3 report §3.3 and every released fine-grained FP8 checkpoint: 128×128 weight blocks
FP8_BLOCK = (128, 128)


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


DTYPE_BYTES = {"float8_e4m3fn": 1, "float32": 4, "bfloat16": 2, "float16": 2}


def ceil_div(x: int, m: int) -> int:
    return -(-x // m)


@dataclass(frozen=True)
class QuantScheme:
    """How a checkpoint format stores the experts: the sharded tensors per fused parameter."""

    name: str
    block: tuple[int, int] | None = None   # (rows, cols) of one scale block; None = unquantized

    @property
    def quantized(self) -> bool:
        return self.block is not None

    def expert_tensors(self, param: str, expert_shape: tuple[int, int],
                       row_segments: tuple[int, ...] | None = None) -> tuple[ExpertTensor, ...]:
        """The sharded tensors of fused parameter ``param`` (per-expert shape ``[N, K]``), weight first."""
        n, k = expert_shape
        segments = tuple(row_segments) if row_segments else (n,)
        if sum(segments) != n:
            raise ValueError(f"{param}: row segments {segments} do not add up to {n} rows")
        if not self.quantized:
            return (ExpertTensor(param, TensorRole.WEIGHT, None, (n, k), "weight", segments),)
        bn, bk = self.block
        scale_rows = sum(ceil_div(s, bn) for s in segments)
        return (ExpertTensor(param, TensorRole.WEIGHT, "float8_e4m3fn", (n, k), "weight", segments),
                ExpertTensor(f"{param}_scale_inv", TensorRole.SCALE, "float32", (scale_rows, ceil_div(k, bk)),
                             "weight_scale_inv", segments))


UNQUANTIZED = QuantScheme("none")
FP8_BLOCK_SCHEME = QuantScheme("fp8-block", FP8_BLOCK)

#: what every rank holds in full, and in which form (docs/MODELS.md; the loader follows it)
REPLICATED: dict[str, str] = {
    "router (gate.weight)": "replicated, checkpoint dtype (never quantized in released FP8 checkpoints)",
    "e_score_correction_bias": "replicated, float32",
    "shared experts, attention, dense MLPs": "replicated; FP8 ones dequantized to the compute dtype at load",
    "embeddings, lm_head, norms": "replicated, unquantized in the checkpoint",
}
