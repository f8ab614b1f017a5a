"""DWDP on the shared MoE stack: every MoE layer reads the composite ``[E, ...]`` expert views.

Per forward: ``mgr.start_forward()``; per MoE layer: ``wait_and_bind(layer)`` (waits for this
layer's peer copies on the compute stream, no host sync on CUDA) → ``moe_stack.full_moe`` on the
composites → ``finish_layer(layer)`` after the kernels are enqueued (records the WAR event that lets
the copy engine reuse the slot). No collective at run time: a rank never waits for another rank.

Invariants: the composites hold bitwise the experts ``moe_stack.expert_weights`` generates (each
rank fills only its own range ``[r·s, min(r·s+k, E))`` straight into its shareable allocation);
``finish_layer`` is never called before the layer's MoE kernels were issued.
"""

from __future__ import annotations

import torch

from dwdp_runtime.config import DwdpConfig
from dwdp_runtime.manager import DwdpManager

from .moe_stack import StackConfig, fill_experts, full_moe


def dwdp_config(cfg: StackConfig, world: int) -> DwdpConfig:
    """The minimal covering sharding (k = ⌈E/d⌉, s = ⌈(E−k)/(d−1)⌉), as ``dwdp plan`` assumes."""
    return DwdpConfig.even(dwdp_size=world, num_experts=cfg.experts)


def build_manager(cfg: StackConfig, *, rank: int, world: int, rendezvous, backend: str, device, dtype,
                  token: str = "", granularity: int | None = None) -> DwdpManager:
    mgr = DwdpManager.create(config=dwdp_config(cfg, world), rank=rank, rendezvous=rendezvous,
                             backend=backend, device=device, token=token, granularity=granularity)
    try:
        for layer in range(cfg.layers):
            mgr.add_layer(layer)
            for name, shape in cfg.expert_shapes().items():
                mgr.add_expert_weight(layer, name, expert_shape=shape, dtype=dtype,
                                      fill=lambda view, a, b, l=layer, n=name: fill_experts(cfg, l, n, view, a, b))
        mgr.setup()
    except BaseException:
        mgr.release(barrier=False)
        raise
    return mgr


class DwdpMoE:
    """Callable ``(layer, hn, w, ids) → [T, H]`` for ``moe_stack.forward``; call ``start_forward``
    once per forward before the first layer."""

    def __init__(self, mgr: DwdpManager, impl: str):
        self.mgr, self.impl = mgr, impl

    def start_forward(self) -> None:
        self.mgr.start_forward()

    def __call__(self, layer: int, hn: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        experts = self.mgr.wait_and_bind(layer)
        out = full_moe(hn, w, ids, experts, self.impl)
        self.mgr.finish_layer(layer)
        return out
