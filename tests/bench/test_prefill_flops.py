"""bench/prefill.py's FLOP count on real configs written by ``synth`` (the MFU denominator)."""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

pytest.importorskip("transformers")


def _cfg(tmp_path, arch, **kw):
    from dwdp_worker.checkpoint.loader import load_config
    from dwdp_worker.checkpoint.synth import write_synthetic

    return load_config(write_synthetic(arch, tmp_path / arch, **kw))


def test_qwen3_counts_by_hand(tmp_path):
    from prefill import prefill_flops

    # 3 layers: layer 1 dense (mlp_only_layers), hidden 64, 4 heads × 16 (2 KV heads), 8 experts × I 32, top-2
    cfg = _cfg(tmp_path, "qwen3_moe", hidden_size=64, num_layers=3, num_experts=8, moe_intermediate_size=32,
               intermediate_size=128, num_heads=4, top_k=2)
    f = prefill_flops(cfg, [10, 6])
    t = 16
    assert f["attention_projections"] == 3 * (2 * t * 64 * (64 + 2 * 32) + 2 * t * 64 * 64)
    assert f["attention"] == 3 * sum(2 * 4 * 32 * n * (n + 1) // 2 for n in (10, 6))
    assert f["routed_experts"] == 2 * 6 * t * 2 * 64 * 32
    assert f["router"] == 2 * 2 * t * 64 * 8
    assert f["dense_mlp"] == 1 * 6 * t * 64 * 128
    assert f["total"] == sum(v for k, v in f.items() if k != "total")


def test_every_arch_counts_its_experts(tmp_path):
    from prefill import prefill_flops

    for arch in ("qwen3_moe", "mixtral", "deepseek_v3"):
        f = prefill_flops(_cfg(tmp_path, arch), [32])
        assert f["routed_experts"] > 0 and f["router"] > 0 and f["attention"] > 0, (arch, f)
