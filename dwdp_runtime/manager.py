"""DwdpManager: the facade a model talks to — lifecycle, layer registry, run-time hooks.

Lifecycle::

    mgr = DwdpManager.create(config=cfg, rank=r, rendezvous=rdzv, backend="auto")
    for layer in moe_layers_in_forward_order:             # the single source of truth for orders
        mgr.add_layer(layer)
        mgr.add_expert_weight(layer, "gate_up_proj", expert_shape=(2*I, H), dtype=dt, fill=...)
        mgr.add_expert_weight(layer, "down_proj", expert_shape=(H, I), dtype=dt, fill=...)
    mgr.setup()                                           # exchange handles, map composites, fill edges
    # per forward:
    mgr.start_forward()
    for each MoE layer:  tensors = mgr.wait_and_bind(layer)   # {weight name: composite}; the model binds them
                         ... enqueue the MoE kernels ...
                         mgr.finish_layer(layer)
    mgr.release()                                         # idempotent; also on __exit__
    # a forward in a CUDA graph: mgr.join_copies(); with torch.cuda.graph(g), mgr.capture(): model(...)
    #                            then per forward mgr.join_copies(); g.replay()   (WeightManager docstring)

``fill`` is either a tensor ``[b−a, *expert_shape]`` with this rank's experts, or a callable
``fill(view, start, end)`` that writes experts ``[start, end)`` into ``view`` (the loader reads
safetensors slices straight into the shareable allocation: a rank never materialises all experts).

Reload (issue #30, ``config.on_uncovered == "reload"``): ``set_membership`` first calls ``reload_uncovered``,
which reads the experts no survivor holds from the checkpoint through the same ``fill`` readers into private runs
of this rank (``holders_reload``) — only those experts' bytes — so the re-plan finds a source for every expert.
A loader whose readers need their files reopened sets ``reload_source`` (a context manager factory, e.g.
``SafetensorsIndex.reopened``; what it yields may count ``bytes_read``).

Elastic groups (issue #30; ``config.elastic``): the transport serves this rank's exports for its whole life and
``member_record()`` says where. ``set_membership(membership, records)`` follows every epoch — ranks lost are
dropped, ranks that joined (a replacement: the same rank, a new incarnation) are imported from their
``elastic.records.MemberRecord``. A replacement calls ``prepare_join(join)`` before ``setup()``: it imports the
members' memory from their records and plans over them, with no collective (the members keep serving).

There is no process-global manager: the model receives its manager explicitly.
Any failure in ``setup`` releases everything created so far before re-raising.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from typing import Any, Callable, ContextManager, Hashable, Mapping

from .config import DwdpConfig
from .contract import DEFAULT_TRANSFER, Backend
from .contract import OnUncovered
from .holders_reload import ReloadReport, orphaned_runs, private_runs_of, with_private_runs
from .layout import DEFAULT_PAGE_MULTIPLIER, coverage
from .memory import MemoryBackend, select_backend
from .memory.base import nbytes_of
from .rendezvous import Rendezvous, token_key
from .streams import HostStreams, Streams
from .transport import Transport
from .weight_buffer import WeightBuffer, WeightSpec
from .weight_manager import WeightManager

log = logging.getLogger(__name__)


def make_streams(memory: MemoryBackend, *, transfer: str = DEFAULT_TRANSFER, copy_delay_s: float = 0.0) -> Streams:
    if memory.name == "host":
        return HostStreams(transfer=transfer, copy_delay_s=copy_delay_s)
    from .cuda_streams import CudaStreams

    return CudaStreams(device=memory.device, transfer=transfer)


class DwdpManager:
    def __init__(self, *, config: DwdpConfig, rank: int, rendezvous: Rendezvous, memory: MemoryBackend,
                 streams: Streams, token: str = "", page_multiplier: int = DEFAULT_PAGE_MULTIPLIER,
                 progress: bool = False, incarnation: str | None = None):
        if not 0 <= rank < config.dwdp_size:
            raise ValueError(f"rank {rank} outside the group [0, dwdp_size={config.dwdp_size})")
        if rendezvous.world_size != config.dwdp_size:
            raise ValueError(f"rendezvous has {rendezvous.world_size} ranks, dwdp_size is {config.dwdp_size}")
        self.config, self.rank, self.rendezvous = config, rank, rendezvous
        self.memory, self.streams = memory, streams
        self.progress = progress
        self.holders = config.holders()
        self.ranges = self.holders.primary
        # this process's id in the group's membership (a replacement of this rank gets another)
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.transport = Transport(memory=memory, rendezvous=rendezvous, rank=rank, ranges=self.ranges,
                                   token_key=token_key(token), holders=self.holders, serve_exports=config.elastic)
        self.buffer = WeightBuffer(memory=memory, streams=streams, transport=self.transport, rank=rank,
                                   ranges=self.ranges, num_slots=config.num_prefetch_slots,
                                   page_multiplier=page_multiplier, contention_opt=config.contention_opt,
                                   holders=self.holders)
        # the members this rank plans over, each with its incarnation ("" until the formation names them)
        self.incarnations: dict[int, str] = {r: "" for r in range(config.dwdp_size)}
        self.incarnations[rank] = self.incarnation
        self.join = None          # elastic.entry.JoinPoint of a replacement (prepare_join), else None
        self.replans = 0
        self.rejoins = 0          # replacements this rank imported at their admission
        self.reloads: list[ReloadReport] = []   # every reload of experts without a surviving holder, in order
        # opens what the fill readers read, for the duration of a reload (None: they need nothing opened)
        self.reload_source: Callable[[], ContextManager[Any]] | None = None
        self._layers: list[Hashable] = []
        self._repeated: list[Hashable] = []
        self._specs: dict[Hashable, list[WeightSpec]] = {}
        self.weights: WeightManager | None = None
        self._released = False

    @classmethod
    def create(cls, *, config: DwdpConfig, rank: int, rendezvous: Rendezvous, backend: str = Backend.AUTO.value,
               device=None, token: str = "", granularity: int | None = None, copy_delay_s: float = 0.0,
               progress: bool = False, page_multiplier: int = DEFAULT_PAGE_MULTIPLIER,
               incarnation: str | None = None) -> "DwdpManager":
        memory = select_backend(backend, device=device, granularity=granularity)
        streams = make_streams(memory, transfer=config.transfer, copy_delay_s=copy_delay_s)
        try:
            return cls(config=config, rank=rank, rendezvous=rendezvous, memory=memory, streams=streams,
                       token=token, page_multiplier=page_multiplier, progress=progress, incarnation=incarnation)
        except BaseException:
            streams.close()
            raise

    # -- registration ----------------------------------------------------------------------------
    @property
    def alive(self) -> frozenset[int]:
        """The ranks this rank plans over (every rank until a membership epoch says otherwise)."""
        return frozenset(self.incarnations)

    @property
    def local_range(self) -> tuple[int, int]:
        return self.ranges[self.rank]

    @property
    def device(self):
        return self.memory.device

    @property
    def backend_name(self) -> str:
        """The memory backend in use (``host``, ``cuda/posix_fd``, ``cuda/fabric``); valid after release."""
        return self.memory.name

    def add_layer(self, layer: Hashable, *, repeated: bool = False) -> None:
        if self.weights is not None:
            raise RuntimeError("layers must be registered before setup()")
        if layer in self._specs:
            raise ValueError(f"MoE layer {layer!r} registered twice")
        self._layers.append(layer)
        self._specs[layer] = []
        if repeated:
            self._repeated.append(layer)

    def add_expert_weight(self, layer: Hashable, name: str, *, expert_shape: tuple[int, ...], dtype,
                          fill: Any | Callable[[Any, int, int], None]) -> None:
        if layer not in self._specs:
            raise KeyError(f"add_layer({layer!r}) first")
        shape = tuple(int(d) for d in expert_shape)
        spec = WeightSpec(layer, name, shape, dtype, nbytes_of(shape, dtype))
        a, b = self.local_range

        def _fill(view):
            if callable(fill):
                fill(view, a, b)
            else:
                if tuple(fill.shape) != tuple(view.shape):
                    raise ValueError(f"{layer}/{name}: local experts have shape {tuple(fill.shape)}, "
                                     f"expected {tuple(view.shape)} (experts [{a}, {b}))")
                view.copy_(fill)

        self.transport.add((layer, name), expert_shape=spec.expert_shape, dtype=dtype,
                           expert_bytes=spec.expert_bytes, fill=_fill,
                           fill_replica=fill if callable(fill) else None)
        self._specs[layer].append(spec)

    # -- setup -----------------------------------------------------------------------------------
    def prepare_join(self, join) -> None:
        """This rank replaces a lost one in a running elastic group: ``setup()`` imports the members of ``join``
        (an ``elastic.entry.JoinPoint``) from their records and plans over them and this rank."""
        if self.weights is not None:
            raise RuntimeError("prepare_join() must come before setup()")
        if not self.config.elastic:
            raise ValueError("only an elastic group (expert_replicas > 1 or on_uncovered=reload) can be joined")
        self.join = join
        self.incarnations = {**join.membership.incarnations, self.rank: self.incarnation}
        self.buffer.alive = self.alive

    def name_members(self, membership) -> None:
        """The formation's epoch 0 (``elastic.entry.complete_formation``): which process serves each rank, so that a
        later epoch tells a replacement (another incarnation) from the member it replaces."""
        if membership.incarnations.get(self.rank) != self.incarnation:
            raise ValueError(f"epoch {membership.epoch} names rank {self.rank} as "
                             f"{membership.incarnations.get(self.rank)!r}, this process is {self.incarnation!r}")
        if set(membership.incarnations) != set(self.incarnations):
            raise ValueError(f"epoch {membership.epoch} has members {sorted(membership.alive)}, this rank plans over "
                             f"{sorted(self.incarnations)}")
        self.incarnations = dict(membership.incarnations)

    def member_record(self):
        """This rank's ``elastic.records.MemberRecord`` (an elastic group, after setup)."""
        return self.transport.record(self.incarnation)

    def setup(self) -> None:
        if self.weights is not None:
            raise RuntimeError("setup() already ran")
        if not self._layers:
            raise RuntimeError("no MoE layer registered: nothing for DWDP to shard")
        try:
            specs = [s for layer in self._layers for s in self._specs[layer]]
            peers = self.buffer.peers_needed(specs) - {self.rank}
            if any(self.holders.replicas) or self.config.elastic:
                # every peer's every handle, so that any survivor can be a source without a new exchange
                peers = set(range(self.config.dwdp_size)) - {self.rank}
            if self.join is not None:
                with _progress(self.progress, len(self.join.records), "dwdp: importing the members' handles") as bar:
                    self.transport.join_exchange(self.join.records, progress=bar.update)
            else:
                with _progress(self.progress, len(peers) * len(specs), "dwdp: importing peer handles") as bar:
                    self.transport.exchange(sorted(peers), progress=bar.update)
            with _progress(self.progress, len(self._layers), "dwdp: mapping composite tensors") as bar:
                self.buffer.build(self._layers, self._specs, progress=bar.update)
            self.weights = WeightManager(buffer=self.buffer, streams=self.streams, layers=self._layers,
                                         num_slots=self.config.num_prefetch_slots, repeated=self._repeated)
        except BaseException:
            self.release(barrier=False)
            raise

    # -- run-time hooks ----------------------------------------------------------------------------
    def _ready(self) -> WeightManager:
        if self.weights is None:
            raise RuntimeError("DwdpManager.setup() has not run (or the manager was released)")
        return self.weights

    def start_forward(self) -> None:
        self._ready().start_forward()

    def wait_and_bind(self, layer: Hashable) -> dict[str, Any]:
        """Wait for the layer's copies (stream wait, not host sync) and bind its slot: ``{weight name:
        composite}``. The runtime never touches a model; the worker's hook rebinds the parameters."""
        return self._ready().wait_and_bind(layer)

    def finish_layer(self, layer: Hashable) -> None:
        """Call after the MoE kernels of ``layer`` were enqueued (records the WAR event)."""
        self._ready().finish_layer(layer)

    def invalidate(self) -> None:
        self._ready().invalidate()

    # -- membership (issue #30: elastic group) ----------------------------------------------------------
    def coverage(self, lost: Any = ()) -> int:
        """Minimum number of holders per expert without ``lost`` (and the ranks already gone)."""
        gone = set(range(self.config.dwdp_size)) - self.alive
        return coverage(self.holders, gone | set(lost))

    def set_membership(self, membership, records: Mapping[int, Any] | None = None) -> frozenset[int]:
        """Serve with ``membership``'s members (an ``elastic.membership.Membership``) from now on. Call between
        forwards. Returns the joined ranks this rank could not import (it plans without them; logged).

        1. quiesce the copy stream (no copy reading anyone is in flight afterwards);
        2. drop (unmap, release) every peer that left or whose incarnation changed: no address of a lost
           process's memory remains (what a device loss requires; docs/RUNTIME.md);
        3. import every peer that joined, from ``records`` (``elastic.records.MemberRecord`` by rank; a replacement
           whose memory cannot be fetched is skipped);
        4. with ``on_uncovered=reload``, read back what no member holds (``reload_uncovered``);
        5. re-plan every layer's copy list over the members (``WeightBuffer.replan``; raises
           ``layout.NoSurvivingHolder`` when an expert has no copy left: the group must restart);
        6. the schedule is invalidated: the next forward re-copies every layer from the new sources.
        Idempotent for the same membership.
        """
        weights = self._ready()
        new = dict(membership.incarnations)
        if new.get(self.rank) != self.incarnation:
            raise ValueError(f"rank {self.rank} ({self.incarnation}) is not in the membership {sorted(new)}: it must "
                             f"stop serving")
        cur = self.incarnations
        if "" in cur.values():
            raise RuntimeError("set_membership before name_members(): the formation's members are not named yet")
        gone = sorted(r for r, inc in cur.items() if r != self.rank and new.get(r) != inc)
        came = sorted(r for r, inc in new.items() if r != self.rank and cur.get(r) != inc)
        if not gone and not came:
            return frozenset()
        self.streams.synchronize()
        for peer in gone:
            self.transport.drop_peer(peer)
        skipped = set()
        for peer in came:
            rec = (records or {}).get(peer)
            try:
                if rec is None or rec.incarnation != new[peer]:
                    raise LookupError(f"no record of its incarnation {new[peer]}")
                self.transport.import_peer(peer, rec)
            except Exception as exc:  # noqa: BLE001 - a replacement this rank cannot read is not a source here
                log.warning("rank %d: cannot import joined rank %d (%s); planning without it", self.rank, peer, exc)
                skipped.add(peer)
        alive = frozenset(new) - skipped
        self.reload_uncovered(alive)
        self.buffer.replan(alive)
        weights.reload_copies()
        self.incarnations = {r: new[r] for r in alive}
        self.replans += 1
        self.rejoins += len(came) - len(skipped)
        return frozenset(skipped)

    def reload_uncovered(self, alive) -> ReloadReport | None:
        """Per ``config.on_uncovered``: with ``reload``, read every expert no rank of ``alive`` holds (and this rank
        has not reloaded yet) from the checkpoint into private runs and plan over them from the next
        ``buffer.replan``; ``None`` when nothing is uncovered or the policy is ``restart`` (the re-plan then
        refuses with ``NoSurvivingHolder``). Raises ``holders_reload.ReloadRefused`` (nothing changed) when the
        runs cannot be allocated or read. Call with the copy stream quiesced (``set_membership`` does)."""
        if self.config.on_uncovered != OnUncovered.RELOAD:
            return None
        shared = self.holders
        view = self.buffer.holders or shared
        runs = orphaned_runs(shared, alive, private_runs_of(view, shared, self.rank))
        if not runs:
            return None
        t0 = time.perf_counter()
        with (self.reload_source() if self.reload_source is not None else contextlib.nullcontext()) as src:
            read0 = getattr(src, "bytes_read", None)
            allocated = self.transport.add_private_runs(runs)
            read = getattr(src, "bytes_read", None)
        self.buffer.use_holders(with_private_runs(view, self.rank, runs))
        experts = tuple(e for a, b in runs for e in range(a, b))
        specs = [s for layer in self._layers for s in self._specs[layer]]
        report = ReloadReport(experts=experts, runs=runs, nbytes=len(experts) * sum(s.expert_bytes for s in specs),
                              allocated_bytes=allocated,
                              bytes_read=None if read0 is None or read is None else read - read0,
                              seconds=time.perf_counter() - t0)
        self.reloads.append(report)
        log.warning("rank %d: %s", self.rank, report.describe())
        return report

    def capture(self):
        """Context manager for one forward captured in a CUDA graph (``WeightManager.capture``)."""
        return self._ready().capture()

    def join_copies(self) -> None:
        """Before a graph replay: later compute work waits for every copy enqueued so far."""
        self._ready().join_copies()

    def mid_sequence(self) -> bool:
        """Whether a forward is under way (a capture or replay needs a forward boundary)."""
        return self._ready().schedule.mid_sequence()

    @property
    def num_restarts(self) -> int:
        return self.weights.num_restarts if self.weights else 0

    @property
    def bind_wait_s(self) -> float:
        """Host seconds spent in ``wait_and_bind`` so far (0 before setup and after release)."""
        return float(self.weights.stats.get("bind_wait_s", 0.0)) if self.weights else 0.0

    def composite(self, layer: Hashable, name: str):
        return self.buffer.tensors(layer)[name]

    def stats(self) -> dict[str, Any]:
        out = {"restarts": self.num_restarts, "backend": self.backend_name, "transfer": self.streams.transfer,
               "members": len(self.alive), "replans": self.replans, "rejoins": self.rejoins,
               "coverage": self.coverage(),
               "reloaded_experts": sorted(e for rep in self.reloads for e in rep.experts)}
        if self.weights:
            out.update(self.weights.stats)
        out["remote_bytes_per_forward"] = sum(self.buffer.remote_bytes_per_layer.values())
        return out

    # -- teardown ------------------------------------------------------------------------------------
    def release(self, *, barrier: bool = True) -> None:
        """Idempotent. The model must not run after this (its parameters point at unmapped memory)."""
        if self._released:
            return
        self._released = True
        self.weights = None
        try:
            self.streams.synchronize()
        except Exception as exc:  # noqa: BLE001 - tear down regardless
            log.warning("copy stream failed during release: %s", exc)
        self.buffer.release()
        self.transport.release(barrier=barrier)
        self.streams.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.release(barrier=exc_type is None)


class _progress:
    """tqdm when asked for, a no-op otherwise (same ``update`` API)."""

    def __init__(self, enabled: bool, total: int, desc: str):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="handle", leave=False)

    def update(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.close()
