"""Presets: weight dtypes, hardware and models, each number with its source.

Pure data, no logic beyond lookups. Invariants:
  * every hardware number is per GPU, in SI units (FLOP/s, bytes/s, bytes);
  * ``nvlink_bytes_per_s`` is ONE direction (a GPU can receive this much while it sends as much);
  * datasheet tensor-core peaks are quoted *dense* (the "with sparsity" figures halved);
  * model presets are the fields of the public Hugging Face ``config.json`` files, so they go
    through the same parser (``model_shapes.from_hf_config``) as a user's file.

Measured efficiency factors (``link_efficiency``, ``copy_compute_tax``) are the only numbers that
are not datasheet peaks; each names the measurement it comes from and where it is an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GB = 1e9
TB = 1e12
MIB = 1 << 20
GIB = 1 << 30


# --------------------------------------------------------------------------------------------- dtypes
@dataclass(frozen=True, kw_only=True)
class WeightDtype:
    """Storage of a quantised weight: ``bits`` per element plus one scale of ``scale_bytes`` per
    ``scale_block`` elements. ``compute`` names the tensor-core peak the GEMM runs at
    (falls back along ``bf16 <- fp8 <- nvfp4`` when a GPU lacks that peak).
    ``act_bytes`` is the activation element size when activations are quantised for dispatch
    (DEP all-to-all); GEMM inputs/outputs are counted at bf16 (2 bytes) regardless."""

    name: str
    bits: int
    scale_block: int = 0
    scale_bytes: int = 0
    compute: str
    act_bytes: float

    @property
    def bytes_per_element(self) -> float:
        scale = self.scale_bytes / self.scale_block if self.scale_block else 0.0
        return self.bits / 8 + scale


DTYPES: dict[str, WeightDtype] = {
    "bf16": WeightDtype(name="bf16", bits=16, compute="bf16", act_bytes=2.0),
    # DeepSeek-V3 FP8 checkpoint: E4M3 weights with one fp32 scale per 128x128 block
    # (DeepSeek-V3 technical report §3.3 "fine-grained quantization"; ``weight_block_size: [128, 128]``
    # in its config.json). Activations dispatched in fp8 with 1 fp32 scale per 128 (same report).
    "fp8": WeightDtype(name="fp8", bits=8, scale_block=128 * 128, scale_bytes=4, compute="fp8",
                       act_bytes=1.0 + 4 / 128),
    # NVFP4: E2M1 values, one E4M3 (1-byte) scale per 16 elements (NVIDIA Blackwell NVFP4 format;
    # the per-tensor fp32 global scale is negligible and ignored). Activations also NVFP4 on dispatch.
    "nvfp4": WeightDtype(name="nvfp4", bits=4, scale_block=16, scale_bytes=1, compute="nvfp4",
                         act_bytes=0.5 + 1 / 16),
    # MXFP4 (OCP MX v1.0; gpt-oss's experts): E2M1 values, one E8M0 (1-byte) exponent per 32 elements.
    # Blackwell's FP4 tensor cores run it at the NVFP4 peak; Hopper has none and falls back to FP8 (W4A8,
    # FP4 -> FP8 in registers) or bf16 (weight-only). Activations dispatched as MXFP8 (1 byte + 1 per 32).
    "mxfp4": WeightDtype(name="mxfp4", bits=4, scale_block=32, scale_bytes=1, compute="nvfp4",
                         act_bytes=1.0 + 1 / 32),
}

ACT_BYTES = 2  # bf16 activations everywhere a GEMM reads or writes them


# ------------------------------------------------------------------------------------------- hardware
@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One GPU of a system. ``peak_flops`` maps compute dtype -> dense FLOP/s (missing = no such
    tensor-core path). ``link_efficiency``: fraction of ``nvlink_bytes_per_s`` a copy-engine
    copy reaches. ``copy_compute_tax``: fractional slow-down of compute while copies run
    concurrently. ``reserved_bytes``: CUDA context, allocator slack, workspaces (assumed)."""

    name: str
    description: str
    peak_flops: dict[str, float]
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    memory_bytes: float
    max_group: int
    link_efficiency: float
    copy_compute_tax: float
    reserved_bytes: float = 4 * GIB  # assumption, not measured: context + cuBLAS/attention workspaces
    sources: tuple[str, ...] = field(default_factory=tuple)

    def peak(self, compute: str) -> float:
        """Dense peak for ``compute``, falling back nvfp4 -> fp8 -> bf16 (weight-only dequant)."""
        for c in {"nvfp4": ("nvfp4", "fp8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",)}[compute]:
            if c in self.peak_flops:
                return self.peak_flops[c]
        raise KeyError(f"{self.name} has no tensor-core peak for {compute}")

    @property
    def link_bytes_per_s(self) -> float:
        """Achieved per-direction bandwidth of one GPU's NVLink port (peak × measured efficiency)."""
        return self.nvlink_bytes_per_s * self.link_efficiency


# H200 copy-engine NVLink copies measured 388–394 GB/s (docs/DRIVER_FACTS.md, "Copies") against
# 450 GB/s per direction (NVLink 4, 900 GB/s bidirectional, H200 datasheet): 388/450 = 0.862.
# We take the lower end. NB: the calibration against that same measurement is therefore not an
# independent check (docs/PLANNER.md says so).
_H200_LINK_EFF = 388 / 450
# Concurrent GEMM slowed by +9–11 % while a copy-engine copy runs (docs/DRIVER_FACTS.md); midpoint.
_H200_TAX = 0.10
# GB200, DWDP vs DEP per-kernel times from the DWDP paper's breakdown (seed article): attention
# 269.67→320.56 µs, dense GEMM 177.50→189.28 µs, others 241.69→284.32 µs: summed ratio − 1.
_GB200_TAX = (320.56 + 189.28 + 284.32) / (269.67 + 177.50 + 241.69) - 1

HARDWARE: dict[str, Hardware] = {
    "h200-hgx": Hardware(
        name="h200-hgx", description="HGX H200 SXM (8 GPUs, NVLink 4 through NVSwitch)",
        # H200 datasheet: BF16 1,979 / FP8 3,958 TFLOPS *with sparsity* -> dense 989.5 / 1,979. No FP4.
        peak_flops={"bf16": 989.5 * TB, "fp8": 1979 * TB},
        hbm_bytes_per_s=4.8 * TB,        # H200 datasheet: 4.8 TB/s HBM3e
        nvlink_bytes_per_s=450 * GB,     # datasheet 900 GB/s bidirectional; docs/DRIVER_FACTS.md NV18 18×26.6
        memory_bytes=143_771 * MIB,      # docs/DRIVER_FACTS.md: measured 143,771 MiB (datasheet "141 GB")
        max_group=8, link_efficiency=_H200_LINK_EFF, copy_compute_tax=_H200_TAX,
        sources=("NVIDIA H200 datasheet", "docs/DRIVER_FACTS.md (measured 2026-11-29)")),
    "h100-hgx": Hardware(
        name="h100-hgx", description="HGX H100 SXM 80GB (8 GPUs, NVLink 4 through NVSwitch)",
        # H100 SXM datasheet: BF16 1,979 / FP8 3,958 TFLOPS with sparsity -> dense 989.5 / 1,979.
        peak_flops={"bf16": 989.5 * TB, "fp8": 1979 * TB},
        hbm_bytes_per_s=3.35 * TB,       # H100 SXM datasheet: 3.35 TB/s HBM3
        nvlink_bytes_per_s=450 * GB,     # datasheet 900 GB/s bidirectional
        memory_bytes=80 * GIB,           # 80 GB HBM3 (nvidia-smi shows 81,559 MiB)
        # Same NVLink 4 + copy engines as H200: efficiency and tax assumed equal (not measured here).
        max_group=8, link_efficiency=_H200_LINK_EFF, copy_compute_tax=_H200_TAX,
        sources=("NVIDIA H100 datasheet", "link efficiency/tax assumed = H200 measurement")),
    "b200-hgx": Hardware(
        name="b200-hgx", description="HGX B200 (8 GPUs, NVLink 5 through NVSwitch)",
        # HGX B200 datasheet (8 GPUs, with sparsity): FP4 144 PF, FP8 72 PF, BF16 36 PF
        # -> per GPU dense: 9 / 4.5 / 2.25 PFLOP/s.
        peak_flops={"bf16": 2.25e15, "fp8": 4.5e15, "nvfp4": 9e15},
        hbm_bytes_per_s=8 * TB,          # HGX B200: 64 TB/s aggregate / 8
        nvlink_bytes_per_s=900 * GB,     # NVLink 5: 1.8 TB/s bidirectional per GPU
        memory_bytes=180 * GB,           # HGX B200: 1,440 GB / 8
        # No Blackwell copy measurement available: efficiency assumed = H200's; tax from the paper.
        max_group=8, link_efficiency=_H200_LINK_EFF, copy_compute_tax=_GB200_TAX,
        sources=("NVIDIA HGX B200 datasheet", "efficiency assumed = H200", "tax from DWDP paper")),
    "gb200-nvl72": Hardware(
        name="gb200-nvl72", description="GB200 NVL72 (72 GPUs in one NVLink 5 domain)",
        # GB200 NVL72 datasheet (72 GPUs, with sparsity): FP4 1,440 PF, FP8 720 PF, BF16 360 PF
        # -> per GPU dense: 10 / 5 / 2.5 PFLOP/s.
        peak_flops={"bf16": 2.5e15, "fp8": 5e15, "nvfp4": 10e15},
        hbm_bytes_per_s=8 * TB,          # GB200: 8 TB/s HBM3e per GPU
        nvlink_bytes_per_s=900 * GB,     # NVLink 5: 1.8 TB/s bidirectional per GPU (130 TB/s / 72)
        memory_bytes=186 * GB,           # NVL72: 13.4 TB HBM3e / 72
        max_group=16,                    # planner search bound, not a hardware limit (72)
        link_efficiency=_H200_LINK_EFF, copy_compute_tax=_GB200_TAX,
        sources=("NVIDIA GB200 NVL72 datasheet", "efficiency assumed = H200", "tax from DWDP paper")),
}

# ---------------------------------------------------------------------------------------------- models
# Fields copied from the public Hugging Face config.json of each model (only those the planner reads).
MODELS: dict[str, dict] = {
    # deepseek-ai/DeepSeek-V3 and deepseek-ai/DeepSeek-R1 share the architecture (config.json).
    # The MTP layer (num_nextn_predict_layers=1) is not part of the context forward and is ignored.
    "deepseek-v3": {
        "_name": "DeepSeek-V3", "model_type": "deepseek_v3",
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "num_attention_heads": 128, "num_key_value_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "vocab_size": 129280, "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3-235b-a22b": {
        "_name": "Qwen3-235B-A22B", "model_type": "qwen3_moe",
        "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
        "num_hidden_layers": 94, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_experts": 128, "num_experts_per_tok": 8,
        "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False,
    },
    # mistralai/Mixtral-8x22B-v0.1 config.json
    "mixtral-8x22b": {
        "_name": "Mixtral-8x22B", "model_type": "mixtral",
        "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
        "num_local_experts": 8, "num_experts_per_tok": 2,
        "num_attention_heads": 48, "num_key_value_heads": 8,
        "vocab_size": 32768, "tie_word_embeddings": False,
    },
    # Qwen/Qwen3-30B-A3B config.json (the bench's expert shapes: bench/fp4_moe.py, bench/fp8_moe.py)
    "qwen3-30b-a3b": {
        "_name": "Qwen3-30B-A3B", "model_type": "qwen3_moe",
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_experts": 128, "num_experts_per_tok": 8,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "vocab_size": 151936, "tie_word_embeddings": False,
    },
    # openai/gpt-oss-120b config.json (MXFP4 experts; attention sinks, biases and the sliding window are
    # not modelled: they change no weight byte count worth a line here)
    "gpt-oss-120b": {
        "_name": "gpt-oss-120b", "model_type": "gpt_oss",
        "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_local_experts": 128, "num_experts_per_tok": 4,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 201088, "tie_word_embeddings": False,
    },
}
MODELS["deepseek-r1"] = dict(MODELS["deepseek-v3"], _name="DeepSeek-R1")

# Accepted spellings -> canonical preset key.
MODEL_ALIASES = {
    "deepseek-r1": "deepseek-r1", "deepseek-v3": "deepseek-v3", "deepseek_r1": "deepseek-r1",
    "deepseek_v3": "deepseek-v3", "qwen3-235b-a22b": "qwen3-235b-a22b", "qwen3-235b": "qwen3-235b-a22b",
    "mixtral-8x22b": "mixtral-8x22b", "mixtral": "mixtral-8x22b",
    "qwen3-30b-a3b": "qwen3-30b-a3b", "qwen3-30b": "qwen3-30b-a3b", "gpt-oss-120b": "gpt-oss-120b",
    "gpt_oss_120b": "gpt-oss-120b",
}
HARDWARE_ALIASES = {
    "h200": "h200-hgx", "h200-hgx": "h200-hgx", "h100": "h100-hgx", "h100-hgx": "h100-hgx",
    "b200": "b200-hgx", "b200-hgx": "b200-hgx", "gb200": "gb200-nvl72", "gb200-nvl72": "gb200-nvl72",
}


class PresetError(ValueError):
    """An unknown preset name; the message lists the known ones."""


def _norm(name: str) -> str:
    return name.strip().lower().replace(" ", "-")


def _preset(table: dict, key: str | None, *, name: str, what: str, known) -> Any:
    if key not in table:
        raise PresetError(f"unknown {what} {name!r}; known: {', '.join(known)}")
    return table[key]


def get_hardware(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    return _preset(HARDWARE, HARDWARE_ALIASES.get(_norm(name)), name=name, what="hardware preset",
                   known=sorted(HARDWARE))


def get_dtype(name: str | WeightDtype) -> WeightDtype:
    if isinstance(name, WeightDtype):
        return name
    return _preset(DTYPES, _norm(name), name=name, what="dtype", known=DTYPES)
