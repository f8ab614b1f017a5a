"""Per-rank expert memory by part — weights, scales, pool — from the same layout the runtime maps.

Pure. One function (``expert_memory``) answers "how many bytes does rank r hold for the experts?" for a
quantization scheme, and the three places that need the number call it: the loader's ``LoadReport`` (what was
actually allocated), ``dwdp plan`` (``planner.memory``) and the operator's memory check (through the planner).

  weights  Σ over MoE layers and weight tensors of the local handle (``layout.composite_layout.local_bytes``:
           the rank's experts rounded up to the granularity)
  scales   the same for the scale tensors (FP8: ``*_scale_inv``); each is its own handle, so a scale tensor
           smaller than the granularity still costs one granule per layer (2 MiB on H200)
  pool     ``slots`` × the pool pages one MoE layer maps (all its tensors), worst layer per slot
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .. import layout
from .scheme import FP8_SCALE_BLOCK, ExpertTensor, QuantScheme, TensorRole


@dataclass(frozen=True)
class ExpertMemory:
    weights: int
    scales: int
    pool: int

    @property
    def total(self) -> int:
        return self.weights + self.scales + self.pool


def layer_tensors(scheme: QuantScheme, params: Sequence[tuple[str, tuple[int, int], tuple[int, ...]]]
                  ) -> list[ExpertTensor]:
    """The sharded tensors of one MoE layer: ``params`` = (name, per-expert [N, K], row segments)."""
    out: list[ExpertTensor] = []
    for name, shape, segs in params:
        out.extend(scheme.expert_tensors(name, shape, segs))
    return out


def expert_memory(*, tensors: Sequence[ExpertTensor], num_moe_layers: int, num_experts: int,
                  ranges: Sequence[tuple[int, int]], rank: int, slots: int, granularity: int,
                  compute_itemsize: int = 2, page_multiplier: int = layout.DEFAULT_PAGE_MULTIPLIER) -> ExpertMemory:
    """Bytes rank ``rank`` maps for the experts of ``num_moe_layers`` identical MoE layers: ``layers_memory`` of
    the layers, from one layer's layouts (the planner asks this for every rank of every candidate sharding —
    thousands of times for one ``dwdp plan`` — so the per-layer work is not repeated for each identical layer)."""
    one = layers_memory(layers=[tensors], num_experts=num_experts, ranges=ranges, rank=rank, slots=1,
                        granularity=granularity, compute_itemsize=compute_itemsize, page_multiplier=page_multiplier)
    page = layout.pool_page_bytes(granularity, page_multiplier)
    pool_pages = sum(layout.slot_pool_pages([one.pool // page] * num_moe_layers, slots))
    return ExpertMemory(one.weights * num_moe_layers, one.scales * num_moe_layers, pool_pages * page)


def layers_memory(*, layers: Sequence[Sequence[ExpertTensor]], num_experts: int, ranges: Sequence[tuple[int, int]],
                  rank: int, slots: int, granularity: int, compute_itemsize: int = 2,
                  page_multiplier: int = layout.DEFAULT_PAGE_MULTIPLIER) -> ExpertMemory:
    """Bytes rank ``rank`` maps for MoE ``layers`` (forward order; each its list of sharded tensors): local
    handles by role, and the pool as the weight buffer sizes it (``layout.slot_pool_pages``)."""
    weights = scales = 0
    pages_per_layer = []
    for tensors in layers:
        pages = 0
        for t in tensors:
            lay = layout.composite_layout(num_experts=num_experts, expert_bytes=t.expert_bytes(compute_itemsize),
                                          local_range=tuple(ranges[rank]), granularity=granularity,
                                          page_multiplier=page_multiplier)
            if t.role is TensorRole.SCALE:
                scales += lay.local_bytes
            else:
                weights += lay.local_bytes
            pages += lay.pool_pages
        pages_per_layer.append(pages)
    pool_pages = sum(layout.slot_pool_pages(pages_per_layer, slots))
    return ExpertMemory(weights, scales, pool_pages * granularity * page_multiplier)


#: the most re-encoded (e4m3) expert bytes a W4A8 forward holds at once, per projection: a layer whose experts
#: need more is re-encoded and multiplied in chunks of experts (``kernels.w4a8_moe``: each GEMM launch skips the
#: plan's blocks of other chunks). DeepSeek-R1's 256 experts are 11.3 GB in e4m3 per layer — at d = 4 on an H200
#: that would not fit beside its FP4 weights; 1 GiB is 8 gate_up and 4 down launches per layer there, and one
#: launch each for Qwen3-30B-A3B (0.6 GB)
W4A8_SCRATCH_BUDGET = 1 << 30


def _blocks(n: int) -> int:
    return -(-n // FP8_SCALE_BLOCK)


def _w4a8_projection_bytes(rows: int, cols: int, halves: int = 1) -> int:
    """One expert's projection of ``halves`` × ``[rows, cols]`` (gate and up are blocked apart) in e4m3 plus its
    fp32 128×128 block scales (a ragged edge is a block of its own)."""
    return halves * (rows * cols + 4 * _blocks(rows) * _blocks(cols))


def w4a8_projections(hidden: int, inter: int, has_gate: bool = True) -> tuple[int, int]:
    """Bytes of one expert's re-encoded ``(gate_up, down)``."""
    return (_w4a8_projection_bytes(inter, hidden, 2 if has_gate else 1), _w4a8_projection_bytes(hidden, inter))


def w4a8_chunk_experts(num_experts: int, expert_bytes: int, budget: int = W4A8_SCRATCH_BUDGET) -> int:
    """Experts re-encoded per chunk: as many as ``budget`` holds (at least one, at most the layer's)."""
    return max(1, min(num_experts, budget // max(expert_bytes, 1)))


def w4a8_scratch_bytes(num_experts: int, hidden: int, inter: int, has_gate: bool = True,
                       budget: int = W4A8_SCRATCH_BUDGET) -> int:
    """Bytes a W4A8 FP4 forward (``kernels.w4a8_moe``) holds re-encoded while a MoE layer runs: the larger
    projection chunk (``w4a8_chunk_experts`` experts of the layer's composite, local and pulled, in e4m3 with
    fp32 block scales)."""
    return max(w4a8_chunk_experts(num_experts, b, budget) * b for b in w4a8_projections(hidden, inter, has_gate))
