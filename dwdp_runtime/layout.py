"""Pure layout math for DWDP: who owns which expert, how a composite tensor is laid out, what to copy.

No torch, no device: everything here is integers, computed identically on every rank from the
shared ``DwdpConfig`` — so no rank ever has to ask another "what do you hold?".

1. ``peer_ranges``: rank r stores experts ``[r*s, min(r*s + k, N))``.
2. ``lookup_owner``: the *lowest* rank whose range holds an expert is its source; every rank uses
   the same rule, so overlapping ranges still give one deterministic source per expert.
3. ``CompositeLayout``: the virtual-address layout of one (layer, weight) on one rank::

       reservation:  [ n_pre pool pages | local handle (L bytes) | n_post pool pages ]
       tensor:                ^pre_padding
       expert e at tensor offset e*eb; expert a (first local) at reservation offset n_pre*PAGE.

   Hardware reason: a physical handle can only be mapped whole (cuMemMap of part of a handle
   returns CUDA_ERROR_NOT_SUPPORTED, docs/DRIVER_FACTS.md), so pool pages (PAGE = 8 × granularity, to keep
   the driver's mapping count low) are mapped whole, and the tensor starts at
   ``pre_padding = n_pre*PAGE − a*eb`` so that expert a lands at offset 0 of the local handle.
   When (b−a)*eb is not a multiple of the granularity the local handle's padded tail holds the
   head of expert b (and possibly more experts when eb < granularity): those bytes are filled
   once at setup (``setup_fill``); run-time copies write only pool pages.
   **Invariant: no run-time copy targets the local handle.**
4. ``CopyPlan``: per (layer, weight), the list of ``CopyOp(peer, src_offset, dst_offset, nbytes)``
   that moves exactly the pool-resident expert bytes, src offsets relative to the peer's local
   handle, dst offsets relative to the reservation base. With ``contention_opt`` the ops are cut
   into 2 MiB slices interleaved round-robin across peers so no single source's copy engine is
   saturated while others idle (the paper's many-to-one contention).
5. ``handle_bytes``: the size of a rank's shareable allocation, used by the transport (create,
   import) and by ``composite_layout`` (the whole-handle map): one formula, or the map fails.
6. ``slot_of`` / ``slot_pool_pages``: MoE order o uses slot ``o mod num_slots`` (schedule and pool);
   per slot, the pool pages one layer needs (all weights of the layer);
   the pool of a slot is sized by the largest layer mapped to it.
7. Replicas (``expert_replicas`` = r, default 1): ``holder_layout`` gives every rank its *primary*
   range (``peer_ranges``, the one its composite maps and serves from: unchanged by r) and its
   *replica runs*: the primary experts of its r−1 ring predecessors ``(i−1 … i−r+1) mod d`` that it
   does not hold already, as maximal contiguous runs, each its own shareable allocation, exported
   to peers and never mapped into the rank's own composite. Every expert of primary(j) then lives
   on ranks j, j+1, …, j+r−1 (mod d): **r ≤ d distinct holders at least**. r = 1 gives no runs:
   exactly today's layout and copy plan.
8. ``surviving_owner``: the source of an expert given the ranks alive — the lowest alive rank whose
   *primary* range holds it (so with everyone alive it is ``lookup_owner``, the plan is today's),
   else the lowest alive rank holding it in a replica run; ``coverage`` is the minimum number of
   alive holders over all experts (0: some expert has no surviving copy). Both pure, identical on
   every rank, so survivors agree on a new plan without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

# pool page = 8 × granularity (16 MiB on 2 MiB granularity): fewer, larger pool mappings keep the
# driver's mapping count (and cuMemMap time at setup) low; larger pages waste more of the last page
DEFAULT_PAGE_MULTIPLIER = 8
SLICE_BYTES = 2 << 20  # contention_opt slice size: 2 MiB


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def ceil_div(x: int, m: int) -> int:
    return -(-x // m)


def pool_page_bytes(granularity: int, page_multiplier: int = DEFAULT_PAGE_MULTIPLIER) -> int:
    """PAGE: the size of one pool allocation (always mapped whole)."""
    return granularity * page_multiplier


def handle_bytes(num_local_experts: int, expert_bytes: int, granularity: int) -> int:
    """Size L of a rank's shareable allocation for one (layer, weight): its experts, rounded up to
    the granularity. The owner creates it, every importer maps it, and the composite maps it whole
    (``CompositeLayout.local_bytes``): all three must agree, so this is the only formula."""
    return round_up(num_local_experts * expert_bytes, granularity)


def peer_ranges(*, dwdp_size: int, num_experts: int, num_experts_per_worker: int,
                num_prefetch_experts: int) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of the experts each rank stores; end is capped at ``num_experts``."""
    return tuple(
        (min(r * num_prefetch_experts, num_experts),
         min(r * num_prefetch_experts + num_experts_per_worker, num_experts))
        for r in range(dwdp_size)
    )


def lookup_owner(expert: int, ranges: Sequence[tuple[int, int]]) -> int:
    """The lowest rank whose range holds ``expert`` (same answer on every rank)."""
    for rank, (start, end) in enumerate(ranges):
        if start <= expert < end:
            return rank
    raise ValueError(f"expert {expert} is owned by no rank (ranges {list(ranges)}): check the coverage rule")


def owner_runs(first: int, last: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Split experts ``[first, last)`` into maximal runs ``(peer, start, end)`` with one owner each."""
    runs: list[tuple[int, int, int]] = []
    e = first
    while e < last:
        peer = lookup_owner(e, ranges)
        end = min(last, ranges[peer][1])
        runs.append((peer, e, end))
        e = end
    return runs


class NoSurvivingHolder(LookupError):
    """No alive rank holds an expert (coverage 0): it must be reloaded, or the group restarted."""


@dataclass(frozen=True)
class HolderLayout:
    """Which experts every rank stores (module docstring, 7).

    ``primary[i]`` = ``peer_ranges``' range of rank i (its composite's local handle);
    ``replicas[i]`` = its replica runs ``((start, end), ...)``, disjoint from ``primary[i]`` and
    from each other, ascending. A *handle index* names one stored run of a rank: 0 is the primary,
    j ≥ 1 is ``replicas[i][j-1]``.
    """

    primary: tuple[tuple[int, int], ...]
    replicas: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def dwdp_size(self) -> int:
        return len(self.primary)

    @property
    def num_experts(self) -> int:
        return max(b for _, b in self.primary)

    def stored(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Every run rank stores, by handle index (0 = primary)."""
        return (self.primary[rank], *self.replicas[rank])

    def stored_experts(self, rank: int) -> int:
        return sum(b - a for a, b in self.stored(rank))

    def holders(self, expert: int) -> tuple[int, ...]:
        """Every rank storing ``expert`` (primary or replica), ascending."""
        return tuple(r for r in range(self.dwdp_size)
                     if any(a <= expert < b for a, b in self.stored(r)))

    def handle_of(self, rank: int, expert: int) -> tuple[int, int]:
        """``(handle index, start of that run)`` of ``expert`` on ``rank``; KeyError when not stored."""
        for h, (a, b) in enumerate(self.stored(rank)):
            if a <= expert < b:
                return h, a
        raise KeyError(f"rank {rank} does not store expert {expert}")


def _runs(experts: Iterable[int]) -> tuple[tuple[int, int], ...]:
    """Sorted experts as maximal contiguous ``(start, end)`` runs."""
    out: list[list[int]] = []
    for e in sorted(set(experts)):
        if out and out[-1][1] == e:
            out[-1][1] = e + 1
        else:
            out.append([e, e + 1])
    return tuple((a, b) for a, b in out)


@lru_cache(maxsize=None)
def holder_layout(*, dwdp_size: int, num_experts: int, num_experts_per_worker: int,
                  num_prefetch_experts: int, expert_replicas: int = 1) -> HolderLayout:
    """Primary ranges and replica runs for replication factor ``expert_replicas`` (docstring, 7)."""
    d, r = dwdp_size, expert_replicas
    if not 1 <= r <= d:
        raise ValueError(f"expert_replicas={r} must be in [1, dwdp_size={d}]")
    primary = peer_ranges(dwdp_size=d, num_experts=num_experts, num_experts_per_worker=num_experts_per_worker,
                          num_prefetch_experts=num_prefetch_experts)
    replicas = []
    for i in range(d):
        a, b = primary[i]
        extra = {e for c in range(1, r) for e in range(*primary[(i - c) % d]) if not a <= e < b}
        replicas.append(_runs(extra))
    return HolderLayout(primary, tuple(replicas))


def surviving_owner(expert: int, holders: HolderLayout, alive: Iterable[int]) -> int:
    """The rank every survivor pulls ``expert`` from (docstring, 8); ``NoSurvivingHolder`` if none."""
    alive = frozenset(alive)
    for rank, (a, b) in enumerate(holders.primary):
        if rank in alive and a <= expert < b:
            return rank
    for rank in sorted(alive):
        if 0 <= rank < holders.dwdp_size and any(a <= expert < b for a, b in holders.replicas[rank]):
            return rank
    raise NoSurvivingHolder(f"expert {expert} has no surviving holder (holders {list(holders.holders(expert))}, "
                            f"alive {sorted(alive)})")


def coverage(holders: HolderLayout, lost_ranks: Iterable[int] = ()) -> int:
    """Minimum, over all experts, of the number of holders not in ``lost_ranks`` (0: a copy is gone)."""
    lost = frozenset(lost_ranks)
    alive = [r for r in range(holders.dwdp_size) if r not in lost]
    counts = [0] * holders.num_experts
    for r in alive:
        for a, b in holders.stored(r):
            for e in range(a, b):
                counts[e] += 1
    return min(counts)


def uncovered_experts(holders: HolderLayout, lost_ranks: Iterable[int]) -> tuple[int, ...]:
    """Experts no surviving rank holds (what a checkpoint reload would have to bring back)."""
    lost = frozenset(lost_ranks)
    return tuple(e for e in range(holders.num_experts) if all(r in lost for r in holders.holders(e)))


@dataclass(frozen=True)
class CompositeLayout:
    """Where every byte of one rank's composite [E, ...] tensor lives (see module docstring)."""

    num_experts: int
    expert_bytes: int
    local_start: int  # a
    local_end: int  # b (exclusive)
    granularity: int
    page_bytes: int
    n_pre: int
    n_post: int
    local_bytes: int  # L: the local handle's size, a multiple of granularity

    @property
    def pre_padding(self) -> int:
        return self.n_pre * self.page_bytes - self.local_start * self.expert_bytes

    @property
    def local_offset(self) -> int:
        """Offset of the local handle inside the reservation."""
        return self.n_pre * self.page_bytes

    @property
    def post_offset(self) -> int:
        return self.local_offset + self.local_bytes

    @property
    def total_bytes(self) -> int:
        return self.post_offset + self.n_post * self.page_bytes

    @property
    def tensor_bytes(self) -> int:
        return self.num_experts * self.expert_bytes

    @property
    def pool_pages(self) -> int:
        return self.n_pre + self.n_post

    def pool_intervals(self) -> list[tuple[int, int]]:
        """Tensor-offset intervals backed by pool pages (run-time copy targets)."""
        out = []
        if self.local_start > 0:
            out.append((0, self.local_start * self.expert_bytes))
        post_t = self.post_offset - self.pre_padding
        if post_t < self.tensor_bytes:
            out.append((post_t, self.tensor_bytes))
        return out

    def local_interval(self) -> tuple[int, int]:
        """Tensor-offset interval backed by the local handle (clipped to the tensor)."""
        lo = self.local_start * self.expert_bytes
        return lo, min(self.tensor_bytes, lo + self.local_bytes)

    def setup_fill_interval(self) -> tuple[int, int]:
        """Bytes of experts >= b that sit in the local handle's padded tail: filled once at setup."""
        lo, hi = self.local_interval()
        return min(hi, self.local_end * self.expert_bytes), hi


def composite_layout(*, num_experts: int, expert_bytes: int, local_range: tuple[int, int],
                     granularity: int, page_multiplier: int = DEFAULT_PAGE_MULTIPLIER) -> CompositeLayout:
    a, b = local_range
    if not 0 <= a < b <= num_experts:
        raise ValueError(f"local range {local_range} must be non-empty inside [0, {num_experts})")
    if expert_bytes <= 0 or granularity <= 0:
        raise ValueError("expert_bytes and granularity must be positive")
    page = pool_page_bytes(granularity, page_multiplier)
    n_pre = ceil_div(a * expert_bytes, page)
    local_bytes = handle_bytes(b - a, expert_bytes, granularity)
    pre_padding = n_pre * page - a * expert_bytes
    covered = n_pre * page + local_bytes  # reservation bytes up to the end of the local handle
    need = pre_padding + num_experts * expert_bytes
    n_post = ceil_div(max(0, need - covered), page)
    return CompositeLayout(num_experts, expert_bytes, a, b, granularity, page, n_pre, n_post, local_bytes)


@dataclass(frozen=True)
class CopyOp:
    """Copy ``nbytes`` from ``peer``'s local handle at ``src_offset`` to the reservation at ``dst_offset``."""

    peer: int
    src_offset: int
    dst_offset: int
    nbytes: int
    handle: int = 0  # which of the peer's allocations: 0 = its primary range, j = its replica run j-1


#: a source run ``(peer, handle index, first expert of that handle, start, end)``
SourceRun = tuple[int, int, int, int, int]


def source_runs(first: int, last: int, ranges: Sequence[tuple[int, int]],
                holders: HolderLayout | None = None, alive: frozenset[int] | None = None) -> list[SourceRun]:
    """Split experts ``[first, last)`` into maximal runs with one source allocation each.

    Without ``alive`` the sources are ``lookup_owner``'s (primary handles only: today's plan); with
    it, ``surviving_owner``'s over ``holders`` — no run names a rank outside ``alive``.
    """
    if alive is None:
        return [(peer, 0, ranges[peer][0], s, e) for peer, s, e in owner_runs(first, last, ranges)]
    if holders is None:
        raise ValueError("a plan over survivors needs the holder layout")
    out: list[SourceRun] = []
    for e in range(first, last):
        peer = surviving_owner(e, holders, alive)
        handle, start = holders.handle_of(peer, e)
        if out and out[-1][:3] == (peer, handle, start) and out[-1][4] == e:
            out[-1] = (peer, handle, start, out[-1][3], e + 1)
        else:
            out.append((peer, handle, start, e, e + 1))
    return out


def _ops_for_interval(lo: int, hi: int, layout: CompositeLayout, ranges: Sequence[tuple[int, int]],
                      holders: HolderLayout | None = None, alive: frozenset[int] | None = None) -> list[CopyOp]:
    """Copy ops for tensor bytes [lo, hi), split by source; dst relative to the reservation."""
    eb = layout.expert_bytes
    ops = []
    for peer, handle, start, s, e in source_runs(lo // eb, ceil_div(hi, eb), ranges, holders, alive):
        t_lo, t_hi = max(lo, s * eb), min(hi, e * eb)
        src = t_lo - start * eb
        ops.append(CopyOp(peer, src, t_lo + layout.pre_padding, t_hi - t_lo, handle))
    return ops


def runtime_copy_ops(layout: CompositeLayout, ranges: Sequence[tuple[int, int]],
                     holders: HolderLayout | None = None, alive: frozenset[int] | None = None) -> list[CopyOp]:
    """Ops filling the pool-backed bytes: run once per layer per forward (remote bytes only)."""
    ops: list[CopyOp] = []
    for lo, hi in layout.pool_intervals():
        ops.extend(_ops_for_interval(lo, hi, layout, ranges, holders, alive))
    return ops


def setup_fill_ops(layout: CompositeLayout, ranges: Sequence[tuple[int, int]],
                   holders: HolderLayout | None = None, alive: frozenset[int] | None = None) -> list[CopyOp]:
    """Ops filling the head of the straddling expert(s) in the local handle's tail, once at setup."""
    lo, hi = layout.setup_fill_interval()
    return _ops_for_interval(lo, hi, layout, ranges, holders, alive) if hi > lo else []


def slice_round_robin(ops: Iterable[CopyOp], slice_bytes: int = SLICE_BYTES) -> list[CopyOp]:
    """Cut ops into ``slice_bytes`` pieces and interleave them across peers (contention_opt)."""
    per_peer: dict[int, list[CopyOp]] = {}
    for op in ops:
        pieces = per_peer.setdefault(op.peer, [])
        for off in range(0, op.nbytes, slice_bytes):
            n = min(slice_bytes, op.nbytes - off)
            pieces.append(CopyOp(op.peer, op.src_offset + off, op.dst_offset + off, n, op.handle))
    out: list[CopyOp] = []
    queues = [per_peer[p] for p in sorted(per_peer)]
    for i in range(max((len(q) for q in queues), default=0)):
        out.extend(q[i] for q in queues if i < len(q))
    return out


@lru_cache(maxsize=None)
def copy_plan(*, num_experts: int, expert_bytes: int, rank: int,
              ranges: tuple[tuple[int, int], ...], granularity: int,
              page_multiplier: int = DEFAULT_PAGE_MULTIPLIER, contention_opt: bool = False,
              holders: HolderLayout | None = None, alive: frozenset[int] | None = None,
              ) -> tuple[CompositeLayout, tuple[CopyOp, ...], tuple[CopyOp, ...]]:
    """``(layout, runtime_ops, setup_ops)`` for one weight shape on one rank; cached by shape.

    Layers whose weight has the same shape share the plan: only base addresses differ. With
    ``alive`` (a membership epoch's survivors) every op reads a surviving holder's allocation
    (``surviving_owner``); the composite layout itself never changes with the membership.
    """
    if alive is not None and rank not in alive:
        raise ValueError(f"rank {rank} plans a membership it is not in (alive {sorted(alive)})")
    layout = composite_layout(num_experts=num_experts, expert_bytes=expert_bytes,
                              local_range=ranges[rank], granularity=granularity,
                              page_multiplier=page_multiplier)
    ops = runtime_copy_ops(layout, ranges, holders, alive)
    if contention_opt:
        ops = slice_round_robin(ops)
    return layout, tuple(ops), tuple(setup_fill_ops(layout, ranges, holders, alive))


def remote_bytes(layout: CompositeLayout) -> int:
    """Bytes a rank pulls per use of this (layer, weight)."""
    return sum(hi - lo for lo, hi in layout.pool_intervals())


def slot_of(order: int, num_slots: int) -> int:
    """Pool slot of the MoE layer at position ``order`` in forward order: the pool the buffer maps
    under the layer and the slot the schedule assigns it (``PrefetchSchedule.slot``) are the same."""
    return order % num_slots


def slot_pool_pages(pages_per_layer: Sequence[int], num_slots: int) -> list[int]:
    """Pages each slot's pool needs: the max over the layers mapped to it (all weights summed)."""
    pages = [0] * num_slots
    for order, n in enumerate(pages_per_layer):
        s = slot_of(order, num_slots)
        pages[s] = max(pages[s], n)
    return pages
