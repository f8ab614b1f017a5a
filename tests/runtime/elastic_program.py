"""A rank of an elastic DWDP group for tests/runtime/test_elastic.py (importable by spawned processes).

Each rank loads seeded experts (``workloads.reference``: every rank can compute the full reference),
serves "forwards" — per MoE layer a matmul of a fixed input with its bound composite, digested —
and, between forwards, applies the membership epochs its ``MembershipAgent`` reports. It tells the
test through ``events`` when it is serving (with its pid, so the test can SIGKILL it) and when it
re-planned; at the end it reports its digests and what it still maps.
"""

from __future__ import annotations

import hashlib
import os
import time

#: layers and per-expert shape: an expert of 8 KiB (float32) is more than the host granularity (4 KiB), so the
#: local handle's padded tail holds no peer expert and every remote expert is pulled at run time
NUM_LAYERS = 3
EXPERT_SHAPE = (32, 64)


def digest(t) -> str:
    return hashlib.sha256(t.contiguous().view(-1).numpy().tobytes()).hexdigest()[:16]


def expected_digests(num_experts: int) -> list[str]:
    """What every rank's forward must produce: computed from the full reference (no DWDP at all)."""
    import torch

    from tests.runtime.workloads import reference

    x = torch.arange(EXPERT_SHAPE[1] * 4, dtype=torch.float32).reshape(4, EXPERT_SHAPE[1]) / 7.0
    return [digest(torch.einsum("ti,eoi->eto", x, reference(layer, "w", num_experts, EXPERT_SHAPE, torch.float32)))
            for layer in range(NUM_LAYERS)]


def write_checkpoint(path, num_experts: int) -> None:
    """The reference experts as a safetensors checkpoint (one fused ``[E, 32, 64]`` tensor per layer)."""
    import torch
    from safetensors.torch import save_file

    from tests.runtime.workloads import reference

    save_file({f"layer{layer}": reference(layer, "w", num_experts, EXPERT_SHAPE, torch.float32).contiguous()
               for layer in range(NUM_LAYERS)}, str(path))


def elastic_rank(rank, world, port, *, num_experts, k, s, replicas, events, run_s, after_replan_forwards,
                 dead_after_s, interval_s, hold=None, checkpoint=None, on_uncovered="restart", settle_epoch=1,
                 fingerprint_extra=None, exclusion_wait_s=30.0):
    """One rank, or a replacement of one (it finds the running group by itself: ``elastic.entry.open_group``).
    Outputs are collected once this rank applied an epoch >= ``settle_epoch`` (a replacement: from its admission)."""
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.elastic.agent import MembershipAgent
    from dwdp_runtime.elastic.entry import claim_fingerprint, complete_formation, open_group
    from dwdp_runtime.elastic.records import GroupFingerprint
    from dwdp_runtime.manager import DwdpManager
    from dwdp_runtime.monitor import PeerMonitor
    from tests.runtime.workloads import reference

    torch.set_num_threads(1)
    cfg = DwdpConfig(dwdp_size=world, num_experts=num_experts, num_experts_per_worker=k, num_prefetch_experts=s,
                     expert_replicas=replicas, on_uncovered=on_uncovered)
    x = torch.arange(EXPERT_SHAPE[1] * 4, dtype=torch.float32).reshape(4, EXPERT_SHAPE[1]) / 7.0
    fingerprint = GroupFingerprint.of(layout=cfg.to_dict(), weights=[NUM_LAYERS, EXPERT_SHAPE], extra=fingerprint_extra)
    incarnation = f"r{rank}-{os.getpid()}"
    entry = open_group(host="127.0.0.1", port=port, rank=rank, world_size=world, job="elastic", group=0, attempt=0,
                       token="t", timeout_s=60, elastic=cfg.elastic, fingerprint=fingerprint, incarnation=incarnation,
                       exclusion_wait_s=exclusion_wait_s)
    rdzv = entry.rendezvous
    if entry.join is None:
        claim_fingerprint(rdzv, fingerprint)
    mgr = DwdpManager.create(config=cfg, rank=rank, rendezvous=rdzv, backend="host", incarnation=incarnation)
    if entry.join is not None:
        mgr.prepare_join(entry.join)
    ckpt = None
    if checkpoint is not None:  # real preads of only [a, b) through the loader's index (worker on PYTHONPATH)
        from dwdp_worker.checkpoint.safetensors_index import SafetensorsIndex

        ckpt = SafetensorsIndex(checkpoint)
    for layer in range(NUM_LAYERS):
        mgr.add_layer(layer)
        if ckpt is not None:
            fill = (lambda view, a, b, key=f"layer{layer}": ckpt.read_rows(key, a, b, view))
        else:
            full = reference(layer, "w", num_experts, EXPERT_SHAPE, torch.float32)
            fill = (lambda view, a, b, full=full: view.copy_(full[a:b]))
        mgr.add_expert_weight(layer, "w", expert_shape=EXPERT_SHAPE, dtype=torch.float32, fill=fill)
    if ckpt is not None:
        ckpt.close()  # as the loader does: nothing stays open; a reload reopens the files
        setup_read = ckpt.bytes_read
        mgr.reload_source = ckpt.reopened
    mgr.setup()
    record = mgr.member_record()
    monitor = PeerMonitor(rdzv, interval_s=interval_s, dead_after_s=dead_after_s, elastic=True, beat_tag=incarnation)
    if entry.join is None:
        membership, records = complete_formation(rdzv, record)
        mgr.name_members(membership)
        agent = MembershipAgent(rdzv, monitor, incarnation=incarnation, membership=membership, record=record,
                                standbys=entry.standbys, records=records)
    else:
        agent = MembershipAgent(rdzv, monitor, incarnation=incarnation, membership=entry.join.membership,
                                record=record, standbys=entry.standbys, candidate=True, records=entry.join.records)
    monitor.start()
    agent.start()
    t_join = None
    if entry.join is not None:
        t0 = time.time()
        agent.request_join()
        m = agent.wait_admitted(60)
        mgr.set_membership(m, agent.records)
        t_join = (t0, time.time())

    def forward() -> list[str]:
        mgr.start_forward()
        out = []
        for layer in range(NUM_LAYERS):
            w = mgr.wait_and_bind(layer)["w"]
            out.append(digest(torch.einsum("ti,eoi->eto", x, w)))
            mgr.finish_layer(layer)
        return out

    before = forward()
    events.put(("serving", rank, os.getpid(), entry.join is not None, t_join))
    after: list[list[str]] = []
    epochs: list[int] = []
    replanned_at = None
    applied = agent.latest.epoch if entry.join is not None else 0
    deadline = time.monotonic() + run_s
    forwards = 1
    while time.monotonic() < deadline:
        m = agent.poll()
        if m is not None:
            mgr.set_membership(m, agent.records)
            applied = m.epoch
            replanned_at = time.time()
            events.put(("replanned", rank, m.epoch, sorted(m.alive), agent.detected_at[m.epoch], replanned_at))
        out = forward()
        forwards += 1
        if applied >= settle_epoch:
            if len(after) < after_replan_forwards:
                after.append(out)
                epochs.append(applied)
            elif hold is None or hold.is_set():
                break
        time.sleep(0.01)
    agent.stop()
    monitor.stop()
    result = {"before": before, "after": after, "epochs": epochs, "forwards": forwards, "alive": sorted(mgr.alive),
              "imported": sorted(mgr.transport.imported_peers), "sources": sorted(mgr.buffer.sources()),
              "stats": {k: v for k, v in mgr.stats().items()
                        if k in ("members", "replans", "coverage", "restarts", "rejoins")},
              "reloads": [(list(r.experts), r.nbytes, r.bytes_read, r.allocated_bytes, r.seconds) for r in mgr.reloads],
              "setup_read": setup_read if ckpt is not None else None, "joined": entry.join is not None,
              "generation": rdzv.generation, "host_rank": rdzv.host_rank,
              "failovers": [(f.generation, f.lost_host, f.new_host, f.seconds) for f in agent.failovers]}
    mgr.release(barrier=False)
    rdzv.close(linger_s=30.0)  # the store's host waits for the members to leave (rdzv.members)
    entry.close()
    return result
