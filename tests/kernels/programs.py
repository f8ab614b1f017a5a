"""Rank program for the kernel tests (importable by spawned processes, which inherit TRITON_INTERPRET)."""

from __future__ import annotations


def dwdp_engine_program(rank, world, port, *, model_dir, batches, experts):
    """Build a DWDP engine (host backend, the composites bound by the hooks) on ``experts``; return logits."""
    import torch

    torch.set_num_threads(1)
    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.rendezvous import StoreRendezvous
    from dwdp_worker.rank.engine import Engine, num_experts_of

    cfg = DwdpConfig.even(dwdp_size=world, num_experts=num_experts_of(model_dir), num_prefetch_slots=2)
    with StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="kernels", token="tok",
                         timeout_s=120.0) as rdzv:
        engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend="host",
                              token="tok", progress=False, experts=experts)
        try:
            impl = engine.model.config._experts_implementation
            return {"impl": impl, "logits": [engine.forward(b).logits.numpy() for b in batches]}
        finally:
            engine.close()
