"""``attach(fused_router=True)`` (``model.router_impl``) on tiny models, under the interpreter: every router module
of the three architectures passes the install probe, its index tensor reaches the experts with the chunk counts,
and the logits stay within bf16 rounding of the model's own router; ``close`` gives the modules their forward back.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_router_in_a_model(arch, tmp_path):
    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model import router_impl

    ckpt = write_synthetic(arch, tmp_path / arch, seed=3, hidden_size=64, num_layers=2, num_experts=8,
                           moe_intermediate_size=32, intermediate_size=64, dtype="bfloat16", vocab_size=128,
                           num_heads=2, top_k=2)
    prompts = [[5, 3, 9, 1, 7, 2, 8], [4, 4, 1]]
    plain = Reference(ckpt, experts="dwdp").logits(prompts)
    ref = Reference(ckpt, experts="dwdp", fused_router=True)
    routers = ref.attachment.routers
    moe_blocks = [m for m in ref.model.modules() if type(m).__name__ in router_impl.ROUTER_CLASSES]
    assert routers and len(routers) == len(moe_blocks)
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen.append(getattr(args[1], router_impl.COUNTS_ATTR, None)))
             for m in ref.model.modules() if type(m).__name__.endswith("Experts")]
    try:
        got = ref.logits(prompts)
    finally:
        for h in hooks:
            h.remove()
    assert seen and all(c is not None for c in seen)  # every experts call got the router's counts
    assert (got - plain).abs().max().item() <= 0.05 * plain.abs().max().item()
    ref.attachment.close()
    assert all("forward" not in m.__dict__ for m in routers)
