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
from .scheme import ExpertTensor, QuantScheme, TensorRole


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
