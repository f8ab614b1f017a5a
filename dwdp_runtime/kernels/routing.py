"""Routing alignment: per-expert lists of (token, k) pairs, each padded to the grouped GEMM's BLOCK_M.

Input: ``topk_ids [T, k]`` (any integer dtype). Pair ``p = t * k + j`` is token ``t``'s j-th choice.
Output (``RoutingPlan``, all on the device, **no host synchronisation, no ``.item()``**):

  * ``sorted_pairs [max_rows]`` int32 — the pairs grouped by expert, in ascending pair order inside each
    expert (stable: the same order ``torch.sort(stable=True)`` gives), each expert's list padded with
    the sentinel ``num_pairs`` up to a multiple of ``block_m``;
  * ``block_expert [max_blocks]`` int32 — the expert of each BLOCK_M row block (-1 past the end);
  * ``num_padded [1]`` int32 — rows in use (the sum of the padded lists); blocks at or past it are idle;
  * ``row_of_pair [num_pairs]`` int32 — the inverse of ``sorted_pairs``: the row of every pair, -1 for a pair
    no expert list holds (written by the scatter kernel beside ``sorted_pairs``: the plan-row passes that go
    token-major — the quantize-and-scatter into GEMM 1's rows, the reduce — read it instead of inverting).

``max_rows = (cdiv(num_pairs, block_m) + min(E, num_pairs)) * block_m`` bounds the padded total from the
host-side shapes alone (every expert wastes < block_m rows), so the GEMM grids are sized without reading
anything back; programs of idle blocks exit at once.

Kernels (4 launches; every one is a pure function of its inputs — no atomics, so the plan is
deterministic bit for bit):
  1. ``_count_kernel``   grid = chunks of BLOCK_PAIRS pairs: a one-hot ``[BLOCK_PAIRS, E_P2]`` compare
                         summed over pairs gives the chunk's count per expert (skipped when the fused
                         router ``router.route`` wrote the same table: ``counts=``);
  2. ``_prefix_kernel``  grid = tiles of EXPERT_TILE experts: walks the chunks in order and writes each
                         chunk's exclusive prefix per expert, and the per-expert totals;
  3. ``_blocks_kernel``  grid = tiles of BLOCK_B row blocks: expert starts = exclusive cumsum of the
                         padded totals (recomputed per program from E numbers — cheaper than a launch);
                         writes ``block_expert`` and the sentinel into every padding row;
  4. ``_scatter_kernel`` grid = chunks again: pair p goes to ``start[e] + prefix[chunk, e] + rank``,
                         ``rank`` = its position among the chunk's pairs of expert e (a cumsum of the
                         one-hot), and that row is ``row_of_pair[p]``. Padding rows (3) and pair rows (4)
                         are disjoint: no race.

Expert ids outside ``[0, E)`` (expert-parallel sentinels) match no expert: the pair is dropped from
every list, and ``reduce_topk`` treats its row as zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: pairs per chunk of the count/scatter kernels: a [BLOCK_PAIRS, E_P2] one-hot of int32 stays at
#: 16K elements (64 KiB across the program's registers) whatever E is
ONE_HOT_ELEMENTS = 16384
#: experts per program of the prefix walk (a power of two, the smallest tile tl.arange handles well)
EXPERT_TILE = 16
#: chunk rows loaded per step of the prefix walk
PREFIX_ROWS = 64
#: row blocks per program of the block-map kernel
BLOCK_B = 64


@dataclass(frozen=True)
class RoutingPlan:
    """Where every (token, k) pair goes in the grouped GEMMs (see module docstring)."""

    sorted_pairs: torch.Tensor   # [max_rows] int32, sentinel = num_pairs
    block_expert: torch.Tensor   # [max_blocks] int32, -1 = idle block
    num_padded: torch.Tensor     # [1] int32
    row_of_pair: torch.Tensor    # [num_pairs] int32, -1 = a dropped pair
    num_pairs: int               # T * k
    top_k: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.numel()


def expert_width(num_experts: int) -> int:
    """Columns of the per-chunk count table (a power of two ≥ ``EXPERT_TILE``)."""
    return max(EXPERT_TILE, triton.next_power_of_2(num_experts))


def chunk_pairs(num_experts: int) -> int:
    """Pairs per chunk of the count/scatter kernels for ``num_experts`` (``router`` writes counts per chunk)."""
    return max(16, ONE_HOT_ELEMENTS // expert_width(num_experts))


def max_padded_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded row blocks, from shapes only (see module docstring)."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts,
                  BLOCK_PAIRS: tl.constexpr, E_P2: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    experts = tl.arange(0, E_P2)
    hit = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)
    tl.store(counts_ptr + chunk * E_P2 + experts, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _prefix_kernel(counts_ptr, prefix_ptr, totals_ptr, num_chunks,
                   E_P2: tl.constexpr, EXPERT_TILE: tl.constexpr, PREFIX_ROWS: tl.constexpr):
    experts = tl.program_id(0) * EXPERT_TILE + tl.arange(0, EXPERT_TILE)
    running = tl.zeros([EXPERT_TILE], dtype=tl.int32)
    for c0 in range(0, num_chunks, PREFIX_ROWS):
        rows = c0 + tl.arange(0, PREFIX_ROWS)
        ok = rows[:, None] < num_chunks
        where = rows[:, None] * E_P2 + experts[None, :]
        tile = tl.load(counts_ptr + where, mask=ok, other=0)
        tl.store(prefix_ptr + where, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=ok)
        running += tl.sum(tile, axis=0)
    tl.store(totals_ptr + experts, running)


@triton.jit
def _padded_starts(totals_ptr, num_experts, BLOCK_M: tl.constexpr, E_P2: tl.constexpr):
    experts = tl.arange(0, E_P2)
    totals = tl.load(totals_ptr + experts)
    padded = tl.where(experts < num_experts, (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    return experts, totals, padded, tl.cumsum(padded, axis=0) - padded


@triton.jit
def _blocks_kernel(totals_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
                   max_blocks, BLOCK_M: tl.constexpr, E_P2: tl.constexpr, BLOCK_B: tl.constexpr):
    experts, totals, padded, starts = _padded_starts(totals_ptr, num_experts, BLOCK_M, E_P2)
    num_padded = tl.sum(padded, axis=0)
    if tl.program_id(0) == 0:
        tl.store(num_padded_ptr, num_padded)
    blocks = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    row0 = blocks * BLOCK_M
    owns = (starts[None, :] <= row0[:, None]) & (padded[None, :] > 0)
    expert = tl.max(tl.where(owns, experts[None, :], -1), axis=1)
    expert = tl.where(row0 < num_padded, expert, -1)
    tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_blocks)
    # the expert's real rows end at start + total; the rest of its last block is padding
    pick = experts[None, :] == expert[:, None]
    used_end = tl.sum(tl.where(pick, starts[None, :] + totals[None, :], 0), axis=1)
    rows = row0[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad = (rows >= used_end[:, None]) & (expert[:, None] >= 0)
    tl.store(sorted_ptr + rows, tl.full([BLOCK_B, BLOCK_M], 0, tl.int32) + num_pairs, mask=pad)


@triton.jit
def _scatter_kernel(ids_ptr, prefix_ptr, totals_ptr, sorted_ptr, row_of_pair_ptr, num_pairs, num_experts,
                    BLOCK_M: tl.constexpr, BLOCK_PAIRS: tl.constexpr, E_P2: tl.constexpr):
    experts, totals, padded, starts = _padded_starts(totals_ptr, num_experts, BLOCK_M, E_P2)
    chunk = tl.program_id(0)
    offs = chunk * BLOCK_PAIRS + tl.arange(0, BLOCK_PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    hit = ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_experts)).to(tl.int32)
    rank = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1
    base = starts + tl.load(prefix_ptr + chunk * E_P2 + experts)
    pos = tl.sum(hit * base[None, :], axis=1) + rank
    tl.store(sorted_ptr + pos, offs, mask=(offs < num_pairs) & (rank >= 0))
    tl.store(row_of_pair_ptr + offs, tl.where(rank >= 0, pos, -1), mask=offs < num_pairs)


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  counts: torch.Tensor | None = None) -> RoutingPlan:
    """The ``RoutingPlan`` of ``topk_ids [T, k]`` for GEMM row blocks of ``block_m`` (a power of two).
    ``counts``: the per-chunk expert counts ``[num_chunks, expert_width(E)]`` already written by the fused
    router (``router.route``): kernel 1 is skipped (3 launches instead of 4); the plan is the same bits."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two")
    ids = topk_ids.contiguous().view(-1)
    num_pairs, top_k = ids.numel(), topk_ids.shape[1]
    dev = ids.device
    e_p2 = expert_width(num_experts)
    block_pairs = chunk_pairs(num_experts)
    num_chunks = max(1, triton.cdiv(num_pairs, block_pairs))
    if counts is not None and tuple(counts.shape) != (num_chunks, e_p2):
        raise ValueError(f"counts {tuple(counts.shape)}: expected ({num_chunks}, {e_p2}) for {num_pairs} pairs")
    max_blocks = max(1, max_padded_blocks(num_pairs, num_experts, block_m))
    i32 = dict(dtype=torch.int32, device=dev)
    fused = counts is not None
    if not fused:
        counts = torch.empty(num_chunks, e_p2, **i32)
    prefix = torch.empty(num_chunks, e_p2, **i32)
    totals = torch.empty(e_p2, **i32)
    sorted_pairs = torch.empty(max_blocks * block_m, **i32)
    block_expert = torch.empty(max_blocks, **i32)
    num_padded = torch.empty(1, **i32)
    row_of_pair = torch.empty(num_pairs, **i32)
    if not fused:
        _count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, BLOCK_PAIRS=block_pairs, E_P2=e_p2)
    _prefix_kernel[(e_p2 // EXPERT_TILE,)](counts, prefix, totals, num_chunks, E_P2=e_p2,
                                           EXPERT_TILE=EXPERT_TILE, PREFIX_ROWS=PREFIX_ROWS)
    _blocks_kernel[(triton.cdiv(max_blocks, BLOCK_B),)](totals, sorted_pairs, block_expert, num_padded, num_pairs,
                                                        num_experts, max_blocks, BLOCK_M=block_m, E_P2=e_p2,
                                                        BLOCK_B=BLOCK_B)
    _scatter_kernel[(num_chunks,)](ids, prefix, totals, sorted_pairs, row_of_pair, num_pairs, num_experts,
                                   BLOCK_M=block_m, BLOCK_PAIRS=block_pairs, E_P2=e_p2)
    return RoutingPlan(sorted_pairs=sorted_pairs, block_expert=block_expert, num_padded=num_padded,
                       row_of_pair=row_of_pair, num_pairs=num_pairs, top_k=top_k, block_m=block_m)
