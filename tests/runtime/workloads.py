"""Rank programs for the multi-process runtime tests (importable by spawned processes)."""

from __future__ import annotations

import contextlib
import os
import time

from dwdp_runtime.streams import HostStreams
from tests.timing import hold


def reference(layer: int, name: str, num_experts: int, shape, dtype):
    """Deterministic expert weights: every rank computes the same reference without communication."""
    import torch

    g = torch.Generator().manual_seed(layer * 131 + len(name))
    return torch.randn((num_experts, *shape), generator=g).to(dtype)


class CaptureCheckingStreams(HostStreams):
    """Real host streams that check CUDA's rules for a capture, inside ``checking()``:
      * every wait is on an event recorded inside it (else cudaErrorStreamCaptureIsolation);
      * the copy stream does work only after it joined the capture (a wait on an event recorded in it), or its
        copies would run eagerly instead of becoming graph nodes;
      * at the end the compute stream has waited on the copy stream's last work (else
        cudaErrorStreamCaptureUnjoined);
    and after it: no eager wait on an event whose last record was inside a capture (CUDA_ERROR_INVALID_VALUE,
    seen on H200) until it is recorded again eagerly."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._recorded: set[int] | None = None
        self._copy_joined = self._joined_back = False
        self._copy_ops = 0
        self._copy_records: dict[int, int] = {}
        self._in_graph: set[int] = set()  # events last recorded inside a capture
        self.capture_waits = 0

    @contextlib.contextmanager
    def checking(self):
        self._recorded, self._copy_joined, self._joined_back, self._copy_records = set(), False, False, {}
        try:
            yield
            if self._copy_joined and not self._joined_back:
                raise AssertionError("the capture ended with the copy stream not joined back")
        finally:
            self._recorded = None

    def _note_record(self, event) -> None:
        if self._recorded is not None:
            self._recorded.add(id(event))
            self._in_graph.add(id(event))
        else:
            self._in_graph.discard(id(event))

    def _wait_checked(self, event, stream: str) -> None:
        if self._recorded is None:
            if id(event) in self._in_graph:
                raise AssertionError(f"an eager wait on the {stream} stream on an event last recorded in a capture")
            return
        if id(event) not in self._recorded:
            raise AssertionError(f"a wait on the {stream} stream inside a capture on an event recorded before it")
        self.capture_waits += 1

    def _copy_op(self) -> None:
        if not self._copy_joined:
            raise AssertionError("copy-stream work inside a capture before the copy stream joined it")
        self._copy_ops += 1
        self._joined_back = False

    def record_compute(self, event) -> None:
        self._note_record(event)
        super().record_compute(event)

    def record_copy(self, event) -> None:
        if self._recorded is not None:
            self._copy_op()
            self._copy_records[id(event)] = self._copy_ops
        self._note_record(event)
        super().record_copy(event)

    def wait_compute(self, event) -> None:
        self._wait_checked(event, "compute")
        if self._recorded is not None and self._copy_records.get(id(event)) == self._copy_ops:
            self._joined_back = True
        super().wait_compute(event)

    def wait_copy(self, event) -> None:
        self._wait_checked(event, "copy")
        if self._recorded is not None:
            self._copy_joined = True
            self._copy_op()
        super().wait_copy(event)

    def enqueue_copies(self, compiled) -> None:
        if self._recorded is not None:
            self._copy_op()
        super().enqueue_copies(compiled)


def composite_program(rank, world, port, *, num_experts, k, s, layers=4, forwards=3, shapes=None,
                      granularity=4096, slots=2, contention_opt=False, copy_delay_s=0.0,
                      skip=None, dtype_name="float32", page_multiplier=8, token="t0k3n", timeout_s=60.0,
                      capture_at=None):
    """Build composites for ``layers`` MoE layers and check them bitwise after every wait_and_bind.

    ``capture_at=f``: forward ``f`` runs as ``PrefillGraphs`` captures one (``join_copies`` first, then inside
    ``DwdpManager.capture``) on ``CaptureCheckingStreams``; on the host the captured forward also executes, so
    its composites are checked like the others'."""
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.manager import DwdpManager
    from dwdp_runtime.memory import select_backend
    from dwdp_runtime.rendezvous import StoreRendezvous

    dtype = getattr(torch, dtype_name)
    shapes = shapes or {"gate_up_proj": (6, 5), "down_proj": (5, 3)}
    cfg = DwdpConfig(dwdp_size=world, num_experts=num_experts, num_experts_per_worker=k,
                     num_prefetch_experts=s, num_prefetch_slots=slots, contention_opt=contention_opt)
    rdzv = StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="test",
                           token=token, timeout_s=timeout_s)
    refs = {(l, n): reference(l, n, num_experts, shp, dtype) for l in range(layers) for n, shp in shapes.items()}
    checks = 0
    if capture_at is None:
        manager = DwdpManager.create(config=cfg, rank=rank, rendezvous=rdzv, backend="host", granularity=granularity,
                                     token=token, copy_delay_s=copy_delay_s, page_multiplier=page_multiplier)
    else:
        manager = DwdpManager(config=cfg, rank=rank, rendezvous=rdzv, memory=select_backend("host", granularity=granularity),
                              streams=CaptureCheckingStreams(copy_delay_s=copy_delay_s), token=token,
                              page_multiplier=page_multiplier)
    with rdzv, manager as mgr:
        a, b = mgr.local_range
        for l in range(layers):
            mgr.add_layer(l)
            for n, shp in shapes.items():
                mgr.add_expert_weight(l, n, expert_shape=shp, dtype=dtype, fill=refs[(l, n)][a:b].clone())
        mgr.setup()
        creates = dict(mgr.memory.stats)
        syncs_at_setup = mgr.streams.stats["synchronize"]
        def checked_forward(f):
            nonlocal checks
            mgr.start_forward()
            for l in range(layers):
                if skip is not None and (f, l) == tuple(skip):
                    continue
                tensors = mgr.wait_and_bind(l)
                for n, t in tensors.items():
                    if not torch.equal(t, refs[(l, n)]):
                        bad = [e for e in range(num_experts) if not torch.equal(t[e], refs[(l, n)][e])]
                        raise AssertionError(f"rank {rank} forward {f} layer {l} {n}: experts {bad} differ")
                    checks += 1
                mgr.finish_layer(l)

        for f in range(forwards):
            with contextlib.ExitStack() as captured:
                if f == capture_at:
                    mgr.join_copies()
                    captured.enter_context(mgr.streams.checking())
                    captured.enter_context(mgr.capture())
                checked_forward(f)
        refusals = None
        if capture_at is not None:
            refusals = _capture_refusals(mgr, layers)
            checked_forward(forwards)  # correct again after the refused captures
        stats = mgr.stats()
        if capture_at is not None:
            stats["capture_waits"] = mgr.streams.capture_waits
            stats["refusals"] = refusals
        stats["allocations_after_setup"] = {k2: mgr.memory.stats[k2] - creates[k2] for k2 in creates}
        stats["checks"] = checks
        stats["local_range"] = (a, b)
        stats["steady_syncs"] = mgr.streams.stats["synchronize"] - syncs_at_setup
        stats["copy_wait_s"] = mgr.streams.stats["wait_s"]
    return stats


def _capture_refusals(mgr, layers) -> list[str]:
    """What a capture mid-sequence and a restart inside a capture raise; leaves the manager at a forward boundary
    with its schedule invalidated (as ``PrefillGraphs`` leaves it after a failed capture)."""
    refusals = []
    mgr.start_forward()
    mgr.wait_and_bind(0)
    try:
        with mgr.capture():
            pass
    except RuntimeError as exc:
        refusals.append(str(exc))
    mgr.finish_layer(0)
    for l in range(1, layers):
        mgr.wait_and_bind(l)
        mgr.finish_layer(l)
    try:
        with mgr.streams.checking(), mgr.capture():
            mgr.start_forward()
            mgr.wait_and_bind(1)  # out of order: the schedule restarts, which needs a device-wide wait
    except RuntimeError as exc:
        refusals.append(str(exc))
    refusals.append(f"capturing afterwards: {mgr.weights.capturing}")
    mgr.invalidate()
    return refusals


def die_after_join(rank, world, port, *, victim, token="t0k3n", timeout_s=5.0, **kw):
    """Every rank joins; ``victim`` dies right after joining; the others try to set up a manager."""
    if rank == victim:
        from dwdp_runtime.rendezvous import StoreRendezvous

        StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="test", token=token,
                        timeout_s=timeout_s)
        hold(0.5, "the victim is seen joined, then dies")
        os._exit(17)
    return composite_program(rank, world, port, token=token, timeout_s=timeout_s, **kw)


def monitored_rank(rank, world, port, *, victim, token="t0k3n", die_after_s=1.0, wait_s=20.0):
    """Ranks heart-beat through the store; ``victim`` dies; the survivors report how they noticed."""
    from dwdp_runtime.monitor import PeerLost, PeerMonitor
    from dwdp_runtime.rendezvous import StoreRendezvous

    rdzv = StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="mon", token=token,
                           timeout_s=10)
    rdzv.barrier("joined")
    # 3 s of silence, not 1: a live survivor's beat thread starved for a second on a loaded 2-core machine
    # must not read as a death (the tests bound the detection at 10 s)
    mon = PeerMonitor(rdzv, interval_s=0.2, dead_after_s=3.0).start()
    t0 = time.monotonic()
    if rank == victim:
        hold(die_after_s, "the victim beats a while, then dies")
        os._exit(17)
    deadline = t0 + wait_s
    out = {"message": None}
    while time.monotonic() < deadline:
        try:
            mon.check()
        except PeerLost as exc:
            out = {"message": str(exc), "after_s": time.monotonic() - t0}
            break
        time.sleep(0.05)
    survivors = [r for r in range(world) if r not in (victim, 0)]
    if rank == 0 and out["message"]:
        # rank 0 hosts the store: keep it up until the other survivors noticed on their own,
        # or they would (correctly, but not what this test checks) report the lost store instead
        stop = time.monotonic() + 10
        while time.monotonic() < stop and not all(rdzv.store_get_nowait(f"noticed/{r}") for r in survivors):
            time.sleep(0.05)
    elif rank != 0 and out["message"]:
        try:
            rdzv.store_set(f"noticed/{rank}", b"1")
        except Exception:  # noqa: BLE001 - the store host may be the victim
            pass
    mon.stop()
    return out
