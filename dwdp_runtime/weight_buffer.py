"""WeightBuffer: the page pool and one composite [E, ...] tensor per (layer, weight).

Setup (``build``):
  1. page pool: per slot, ``slot_pool_pages`` allocations of PAGE = ``layout.pool_page_bytes``
     (``DEFAULT_PAGE_MULTIPLIER`` = 8 × granularity) bytes each
     (the slot's pool is sized by the largest layer mapped to it; pages are always mapped whole);
  2. per (layer, weight): reserve ``layout.total_bytes``; map the layer's slot pages before the
     local allocation (experts [0, a)), the local allocation itself (zero-copy: the rank's own
     experts are never copied), slot pages after it (experts [b, E)); **one** ``set_access`` over
     the whole reservation (on GB200 each access-set call costs an NVLink routing-table entry);
     the tensor starts at ``va + pre_padding`` so expert a sits at offset 0 of the local allocation;
  3. per layer: the absolute copy list from the cached ``layout.copy_plan`` (src = peer view base
     + src_offset, dst = reservation + dst_offset), compiled once by the streams backend;
  4. edge fill: the straddling expert's head in the local allocation's padded tail, copied once.
Layers that share a slot share physical pool pages: the schedule guarantees at most one of them
holds live data at a time. Run time writes pool pages only and allocates nothing.

Re-plan (``replan(alive)``, a membership epoch after a rank loss): only step 3 is redone, from
``copy_plan(..., holders, alive)`` — the composites, pool and mappings stay; every source of the new
copy lists is a surviving holder's allocation (``layout.surviving_owner``). Pure host work: the caller
quiesces the copy stream first (``DwdpManager.set_membership``).

Reloaded experts (``use_holders(view)``, ``holders_reload``): the plan's holder layout becomes this rank's own
view, the group's plus its private runs; the next ``replan`` then sources the reloaded experts from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Sequence

from .layout import (DEFAULT_PAGE_MULTIPLIER, CompositeLayout, HolderLayout, copy_plan, pool_page_bytes, slot_of,
                     slot_pool_pages)
from .memory.base import Allocation, MemoryBackend
from .streams import Streams
from .transport import Transport


@dataclass
class WeightSpec:
    """One expert weight of one MoE layer: ``[num_experts, *expert_shape]`` of ``dtype``."""

    layer: Hashable
    name: str
    expert_shape: tuple[int, ...]
    dtype: Any
    expert_bytes: int


@dataclass
class _Composite:
    spec: WeightSpec
    layout: CompositeLayout
    va: int
    tensor: Any
    mapped: list[tuple[int, int]] = field(default_factory=list)  # (va, nbytes) of each mapping


class WeightBuffer:
    def __init__(self, *, memory: MemoryBackend, streams: Streams, transport: Transport,
                 rank: int, ranges: Sequence[tuple[int, int]], num_slots: int,
                 page_multiplier: int = DEFAULT_PAGE_MULTIPLIER, contention_opt: bool = False,
                 holders: HolderLayout | None = None):
        self.memory, self.streams, self.transport = memory, streams, transport
        self.holders = holders
        self.alive: frozenset[int] | None = None  # None: the full group (today's plan)
        self.rank, self.ranges, self.num_slots = rank, tuple(ranges), num_slots
        self.page_multiplier, self.contention_opt = page_multiplier, contention_opt
        self.page_bytes = pool_page_bytes(memory.granularity, page_multiplier)
        self._pool: list[list[Allocation]] = [[] for _ in range(num_slots)]
        self._composites: dict[Hashable, list[_Composite]] = {}
        self._compiled: dict[Hashable, Any] = {}
        self._tensors: dict[Hashable, dict[str, Any]] = {}
        self.remote_bytes_per_layer: dict[Hashable, int] = {}
        self._released = False

    def plan(self, spec: WeightSpec, alive: frozenset[int] | None = None):
        num_experts = self.ranges[-1][1]
        return copy_plan(num_experts=num_experts, expert_bytes=spec.expert_bytes, rank=self.rank,
                         ranges=self.ranges, granularity=self.memory.granularity,
                         page_multiplier=self.page_multiplier, contention_opt=self.contention_opt,
                         holders=self.holders if alive is not None else None, alive=alive)

    def peers_needed(self, specs: Sequence[WeightSpec]) -> set[int]:
        peers = set()
        for spec in specs:
            _, ops, setup = self.plan(spec)
            peers.update(op.peer for op in ops)
            peers.update(op.peer for op in setup)
        return peers

    def build(self, layers: Sequence[Hashable], specs_by_layer: dict[Hashable, list[WeightSpec]],
              progress=None) -> None:
        """Build pool, composites and copy lists for ``layers`` (in forward order). Rolls back on error."""
        try:
            # a replacement joining a running elastic group builds over the members it joins (``alive``), never
            # over the full group's owners: the lost ranks' memory is not there to read
            pages = [sum(self.plan(s, self.alive)[0].pool_pages for s in specs_by_layer[layer]) for layer in layers]
            for slot, n in enumerate(slot_pool_pages(pages, self.num_slots)):
                self._pool[slot] = [self.memory.create(self.page_bytes) for _ in range(n)]
            setup_copies = []
            for order, layer in enumerate(layers):
                slot = slot_of(order, self.num_slots)
                page_cursor = 0
                copies = []
                composites = []
                for spec in specs_by_layer[layer]:
                    layout, ops, setup = self.plan(spec, self.alive)
                    comp = self._map_composite(spec, layout, slot, page_cursor)
                    composites.append(comp)
                    page_cursor += layout.pool_pages
                    copies += self._absolute(comp, ops)
                    setup_copies += self._absolute(comp, setup)
                self._composites[layer] = composites
                self._tensors[layer] = {c.spec.name: c.tensor for c in composites}  # bound every forward
                self._compiled[layer] = self.streams.compile(copies)
                self.remote_bytes_per_layer[layer] = sum(n for _, _, n in copies)
                if progress:
                    progress(1)
            if setup_copies:
                self.streams.copy_now(setup_copies)
        except BaseException:
            self.release()
            raise

    def _absolute(self, comp: _Composite, ops) -> list[tuple[int, int, int]]:
        """``(dst address, src address, nbytes)`` of a plan's ops for one composite."""
        key = (comp.spec.layer, comp.spec.name)
        return [(comp.va + op.dst_offset, self.transport.peer_view(op.peer, key, op.handle) + op.src_offset, op.nbytes)
                for op in ops]

    def replan(self, alive: frozenset[int]) -> None:
        """Recompile every layer's copy list so that it reads surviving holders only (module docstring).
        Raises ``layout.NoSurvivingHolder`` (nothing changed) when some expert has no surviving copy."""
        if self.holders is None:
            raise RuntimeError("a re-plan needs the holder layout (expert_replicas)")
        alive = frozenset(alive)
        compiled, remote = {}, {}
        for layer, composites in self._composites.items():
            if layer == "__building__":
                continue
            copies = []
            for comp in composites:
                copies += self._absolute(comp, self.plan(comp.spec, alive)[1])
            compiled[layer] = self.streams.compile(copies)
            remote[layer] = sum(n for _, _, n in copies)
        self._compiled.update(compiled)
        self.remote_bytes_per_layer.update(remote)
        self.alive = alive

    def use_holders(self, view: HolderLayout) -> None:
        """Plan over ``view`` from the next ``replan`` on: the group's layout with runs added to this rank only
        (its private, reloaded runs; ``holders_reload.with_private_runs``). Other ranks' runs must not change:
        they are what this rank imported."""
        if self.holders is None:
            raise RuntimeError("a re-plan needs the holder layout (expert_replicas)")
        others = [r for r in range(view.dwdp_size) if r != self.rank]
        if view.primary != self.holders.primary or any(
                view.replicas[r] != self.holders.replicas[r] for r in others) or \
                view.replicas[self.rank][:len(self.holders.replicas[self.rank])] != self.holders.replicas[self.rank]:
            raise ValueError("a holder view may only append runs to this rank's own replica runs")
        self.holders = view

    def sources(self) -> set[int]:
        """Ranks the current copy lists read from (this rank included when it reads its own replicas)."""
        alive = self.alive
        out: set[int] = set()
        for composites in self._composites.values():
            for comp in composites:
                out.update(op.peer for op in self.plan(comp.spec, alive)[1])
        return out

    def _map_composite(self, spec: WeightSpec, layout: CompositeLayout, slot: int, page_cursor: int) -> _Composite:
        va = self.memory.reserve(layout.total_bytes)
        comp = _Composite(spec, layout, va, None)
        self._composites.setdefault("__building__", []).append(comp)  # so release() can find it
        pool = self._pool[slot]
        cursor = va
        for i in range(layout.n_pre):
            self.memory.map(cursor, pool[page_cursor + i])
            comp.mapped.append((cursor, self.page_bytes))
            cursor += self.page_bytes
        self.memory.map(cursor, self.transport.local_allocation((spec.layer, spec.name)))
        comp.mapped.append((cursor, layout.local_bytes))
        cursor += layout.local_bytes
        for i in range(layout.n_post):
            self.memory.map(cursor, pool[page_cursor + layout.n_pre + i])
            comp.mapped.append((cursor, self.page_bytes))
            cursor += self.page_bytes
        self.memory.set_access(va, layout.total_bytes, writable=True)
        comp.tensor = self.memory.as_tensor(va + layout.pre_padding,
                                            (layout.num_experts, *spec.expert_shape), spec.dtype)
        self._composites["__building__"].remove(comp)
        return comp

    def tensors(self, layer: Hashable) -> dict[str, Any]:
        """The layer's composite tensors by weight name (built once at setup; do not mutate)."""
        return self._tensors[layer]

    def compiled_copies(self, layer: Hashable) -> Any:
        return self._compiled[layer]

    def release(self) -> None:
        """Idempotent: unmap every mapping, free reservations, release the pool."""
        if self._released:
            return
        self._released = True
        for comps in self._composites.values():
            for comp in comps:
                comp.tensor = None
                for va, n in comp.mapped:
                    self.memory.unmap(va, n)
                self.memory.free_reservation(comp.va, comp.layout.total_bytes)
        self._composites.clear()
        self._tensors.clear()
        self._compiled.clear()
        for pages in self._pool:
            for alloc in pages:
                self.memory.release(alloc)
        self._pool = [[] for _ in range(self.num_slots)]
