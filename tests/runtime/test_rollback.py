"""Setup failures roll back: no fd, mapping or allocation survives a failed setup or fill."""

import os

import pytest
import torch

from dwdp_runtime.config import DwdpConfig
from dwdp_runtime.manager import DwdpManager
from dwdp_runtime.rendezvous import RendezvousTimeout, StoreRendezvous

from .group import free_port


def _fds():
    """Open DWDP memfds of this process (other fds come and go with unrelated threads)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:dwdp")
        except OSError:
            pass
    return n


def _maps():
    """Mappings of DWDP memfds (thread stacks and malloc arenas come and go on their own)."""
    with open("/proc/self/maps") as f:
        return sum("memfd:dwdp" in line for line in f)


class _alone:
    """Close rank 0's store at once: no other rank will ever come to leave it."""

    def __init__(self, rdzv):
        self.rdzv = rdzv

    def __enter__(self):
        return self.rdzv

    def __exit__(self, *exc):
        self.rdzv.close(linger_s=0)


def _manager(port, timeout_s=1.0):
    cfg = DwdpConfig(dwdp_size=2, num_experts=6, num_experts_per_worker=3, num_prefetch_experts=3)
    rdzv = StoreRendezvous(host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=timeout_s)
    return rdzv, DwdpManager.create(config=cfg, rank=0, rendezvous=rdzv, backend="host", page_multiplier=1)


def test_failed_setup_releases_everything():
    rdzv, mgr = _manager(free_port())
    with _alone(rdzv):
        fds, maps = _fds(), _maps()
        for layer in range(3):
            mgr.add_layer(layer)
            mgr.add_expert_weight(layer, "w", expert_shape=(40, 30), dtype=torch.float32,
                                  fill=torch.ones(3, 40, 30))
        assert _fds() == fds + 3  # one memfd per (layer, weight)
        with pytest.raises(RendezvousTimeout, match=r"rank\(s\) \[1\] never arrived"):
            mgr.setup()  # rank 1 never comes
        assert _fds() == fds and _maps() == maps
        assert mgr.memory.live == {"allocations": 0, "reservations": 0}
        mgr.release()  # idempotent after the rollback


def test_failing_fill_leaves_nothing_behind():
    rdzv, mgr = _manager(free_port())
    with _alone(rdzv):
        fds, maps = _fds(), _maps()
        mgr.add_layer(0)

        def bad_fill(view, start, end):
            raise OSError("checkpoint shard unreadable")

        with pytest.raises(OSError, match="unreadable"):
            mgr.add_expert_weight(0, "w", expert_shape=(40, 30), dtype=torch.float32, fill=bad_fill)
        with pytest.raises(ValueError, match="expected \\(3, 40, 30\\)"):
            mgr.add_expert_weight(0, "w", expert_shape=(40, 30), dtype=torch.float32, fill=torch.ones(2, 40, 30))
        assert _fds() == fds and _maps() == maps
        assert mgr.memory.live == {"allocations": 0, "reservations": 0}
        mgr.release(barrier=False)


def test_hooks_before_setup_explain_themselves():
    rdzv, mgr = _manager(free_port())
    with _alone(rdzv):
        with pytest.raises(RuntimeError, match="setup\\(\\) has not run"):
            mgr.start_forward()
        with pytest.raises(RuntimeError, match="no MoE layer registered"):
            mgr.setup()
        mgr.release(barrier=False)
