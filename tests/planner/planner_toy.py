"""A toy model and a toy GPU whose roofline numbers are computable by hand."""

from dwdp_runtime.planner.model_shapes import from_hf_config
from dwdp_runtime.planner.presets import Hardware

# hidden 2, one MoE layer with 2 experts of intermediate 1, top-1, one head of dim 2, vocab 4.
TOY_CONFIG = {
    "_name": "toy", "hidden_size": 2, "num_hidden_layers": 1, "num_local_experts": 2,
    "num_experts_per_tok": 1, "intermediate_size": 1, "num_attention_heads": 1,
    "num_key_value_heads": 1, "head_dim": 2, "vocab_size": 4,
}
TOY = from_hf_config(TOY_CONFIG)


def toy_gpu(*, peak=100.0, bw=10.0, link=1.0, memory=1e12, tax=0.0) -> Hardware:
    """100 FLOP/s, 10 B/s HBM, 1 B/s link at 100 % efficiency, no copy tax, no reserve."""
    return Hardware(name="toy", description="toy", peak_flops={"bf16": peak}, hbm_bytes_per_s=bw,
                    nvlink_bytes_per_s=link, memory_bytes=memory, max_group=4, link_efficiency=1.0,
                    copy_compute_tax=tax, reserved_bytes=0)
