"""FP8 block-scaled checkpoints through DWDP on CPU: sharded logits == the dequantized-weights model, bitwise.

Checkpoints: ``dwdp-worker synth ARCH --quant fp8`` of every architecture, sized so the 128×128 blocks are real
(hidden 256 = 2 column blocks; moe_intermediate 192 = a full and a partial row block per projection, so
gate_up's scale rows are per projection: 4, not ⌈384/128⌉ = 3), plus the fused-expert variant. The reference is
plain `transformers` on ``dequantize_checkpoint`` of the same directory (every FP8 tensor replaced by
``fp8_block.dequantize`` of it), in this process on one thread like the ranks.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.runtime.group import run_group
from tests.worker.oracle_group import assert_ranks_equal_references, one_torch_thread, run_oracle_group
from tests.worker.programs import memory_program

from dwdp_runtime import quant
from dwdp_runtime.contract import Switch
from dwdp_runtime.layout import peer_ranges
from dwdp_worker.checkpoint.fp8 import dequantize_checkpoint
from dwdp_worker.checkpoint.loader import load_config
from dwdp_worker.model.registry import UnsupportedModelError
from dwdp_worker.launch.oracle import Reference
from dwdp_worker.checkpoint.synth import write_synthetic

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
SIZES = dict(hidden_size=256, moe_intermediate_size=192, intermediate_size=256, num_heads=4)
BATCHES = [[[5, 17, 42, 3, 99, 7, 8]], [[1, 2, 3], list(range(10, 47)), [200]], [list(range(0, 256, 3))]]
SHARDING = {2: (5, 3), 3: (3, 3), 4: (3, 2)}  # 8 experts: overlapping / 8 % 3 != 0 / overlapping
MiB = 2**20


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    """name -> (fp8 checkpoint, dequantized reference checkpoint, unquantized original)."""
    base = tmp_path_factory.mktemp("fp8")
    out = {}
    for name, arch, fused in [(a, a, False) for a in ARCHS] + [("qwen3_moe_fused", "qwen3_moe", True)]:
        orig = write_synthetic(arch, base / f"{name}-orig", seed=5, **SIZES)
        fp8 = write_synthetic(arch, base / name, seed=5, quant="fp8", fused_experts=fused, **SIZES)
        out[name] = (fp8, dequantize_checkpoint(fp8, base / f"{name}-ref"), orig)
    return out


@pytest.fixture(scope="module")
def references(fp8_models):
    with one_torch_thread():
        out = {}
        for name, (_, ref, orig) in fp8_models.items():
            out[name] = [Reference(ref).logits(b) for b in BATCHES]
            unq = [Reference(orig).logits(b) for b in BATCHES[:1]]
            # the checkpoint really is quantized: the dequantized model is not the original one
            assert not torch.equal(unq[0], out[name][0])
        out["deepseek_v3@bfloat16"] = [Reference(fp8_models["deepseek_v3"][1], dtype="bfloat16").logits(b)
                                       for b in BATCHES]
        return out


def test_fp8_checkpoint_format(fp8_models):
    from safetensors import safe_open

    fp8, _, _ = fp8_models["deepseek_v3"]
    cfg = json.loads((fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        def info(k):
            s = f.get_slice(k)
            return s.get_dtype(), s.get_shape()
        e = "model.layers.1.mlp.experts.3"
        assert info(f"{e}.gate_proj.weight") == ("F8_E4M3", [192, 256])
        assert info(f"{e}.gate_proj.weight_scale_inv") == ("F32", [2, 2])
        assert info(f"{e}.down_proj.weight_scale_inv") == ("F32", [2, 2])
        assert info("model.layers.0.self_attn.q_b_proj.weight")[0] == "F8_E4M3"        # dense: quantized
        assert info("model.layers.1.mlp.shared_experts.up_proj.weight")[0] == "F8_E4M3"
        for unq in ("model.layers.1.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight",
                    "model.layers.1.mlp.gate.e_score_correction_bias", "model.norm.weight"):
            assert info(unq)[0] == "F32", unq
    fused, _, _ = fp8_models["qwen3_moe_fused"]
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 384, 256]
        assert f.get_slice("model.layers.0.mlp.experts.gate_up_proj_scale_inv").get_shape() == [8, 4, 2]


@pytest.mark.parametrize("d", sorted(SHARDING))
def test_fp8_sharded_logits_equal_dequantized_reference(d, fp8_models, references):
    """At d = 2 the same group also serves each checkpoint with ``DWDP_FP8_DENSE=on``: every FP8 ``nn.Linear``
    (attention, dense MLP, shared experts) stays e4m3 on the rank — fewer dense bytes — and on CPU, where each
    forward dequantizes it with the load's own function, the logits are the dequantize-at-load model's bitwise."""
    k, s = SHARDING[d]
    names = list(ARCHS) + (["qwen3_moe_fused", "deepseek_v3@bfloat16"] if d == 2 else [])
    dense_fp8 = [n for n in names if n != "qwen3_moe_fused"] if d == 2 else []

    def run(n, tag):
        return f"{n}-{tag}", str(fp8_models[n.split("@")[0]][0]), k, s, n.split("@")[1] if "@" in n else None
    runs = [run(n, f"d{d}") for n in names] + [run(n, "fp8dense") for n in dense_fp8]
    res = run_oracle_group(d, runs, BATCHES, env={f"{n}-fp8dense": {"DWDP_FP8_DENSE": "on"} for n in dense_fp8})
    ranges = peer_ranges(dwdp_size=d, num_experts=8, num_experts_per_worker=k, num_prefetch_experts=s)
    assert_ranks_equal_references(res, names, d, references, ranges)
    kept = {r: {f"{n}-d{d}": v[f"{n}-fp8dense"] for n in dense_fp8} for r, v in res.items()}
    assert_ranks_equal_references(kept, dense_fp8, d, references, ranges)
    for name in dense_fp8:
        for rank, jobs in res.items():
            on, off = jobs[f"{name}-fp8dense"], jobs[f"{name}-d{d}"]
            linears = set(on["fp8_linears"])
            assert not off["fp8_linears"] and "lm_head" not in linears
            assert any(n.endswith("self_attn.o_proj") for n in linears), (name, sorted(linears))
            if name.startswith("deepseek_v3"):
                assert any(".shared_experts." in n for n in linears) and any(n.endswith("q_b_proj") for n in linears)
            # e4m3 + fp32 scales per 128×128 block instead of the compute dtype's 4 (float32) or 2 (bf16) bytes
            assert on["dense_bytes"] < off["dense_bytes"], (name, on["dense_bytes"], off["dense_bytes"])


def test_a_bad_fp8_dense_mode_is_refused_by_name(monkeypatch):
    from dwdp_worker.checkpoint import fp8_dense

    monkeypatch.setenv("DWDP_FP8_DENSE", "maybe")
    with pytest.raises(ValueError, match="DWDP_FP8_DENSE='maybe': expected one of off, on"):
        fp8_dense.mode()
    monkeypatch.setenv("DWDP_FP8_DENSE", "")
    assert fp8_dense.mode() is Switch.OFF


@pytest.fixture(scope="module")
def big_fp8(tmp_path_factory):
    # bf16: the dense weights (dequantized at load) stay small next to ~96 MiB of FP8 experts (2 MoE layers)
    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("fp8mem") / "q", seed=3, num_experts=32,
                           num_layers=3, hidden_size=512, moe_intermediate_size=1024, intermediate_size=256,
                           vocab_size=256, quant="fp8", dtype="bfloat16")


def test_fp8_rank_reads_only_its_experts_weights_and_scales(big_fp8):
    """As the bf16 memory test: the peak of Engine.build is bounded by the local share (weights + scales)."""
    res = run_group(memory_program, 4, fresh_interpreters=True, model_dir=str(big_fp8), k=8, s=8, harness_timeout_s=180)
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    for rank, (_, r) in sorted(res.items()):
        total, local, dense, peak = r["total_expert_bytes"], r["local_expert_bytes"], r["dense_bytes"], r["peak_growth"]
        per_expert_scales = 4 * (16 * 4 + 4 * 8)  # fp32 gate_up [16, 4] + down [4, 8] (hidden 512, moe 1024)
        assert total >= 90 * MiB and local == total // 4
        assert r["local_scale_bytes"] == 8 * 2 * per_expert_scales  # 8 local experts x 2 MoE layers
        print(f"rank {rank}: peak growth {peak / MiB:.1f} MiB, local experts {local / MiB:.1f} MiB "
              f"(scales {r['local_scale_bytes']} B), dense {dense / MiB:.1f} MiB, all experts {total / MiB:.1f} MiB")
        assert peak <= dense + 2 * r["largest_local_weight"] + 8 * MiB, (rank, peak / MiB)
        assert peak + local < total / 2, (rank, peak / MiB)
        # the report's by-part numbers (the planner's function) are what the runtime allocated
        mapped, handles = r["mapped"], r["handles"]
        assert (mapped.weights, mapped.scales, mapped.pool) == (handles["weights"], handles["scales"], handles["pool"])
        assert 0 < mapped.scales < mapped.weights


@pytest.mark.parametrize("change, says", [
    ({"quant_method": "awq"}, "'awq' is not supported"),
    ({"activation_scheme": "static"}, "static activation scales"),
    ({"weight_block_size": [128, 64]}, r"\[128, 64\]"),
])
def test_bad_fp8_config_is_refused_at_load(fp8_models, tmp_path, change, says):
    import shutil

    src, _, _ = fp8_models["mixtral"]
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=says) as exc:
        load_config(dst)
    assert "mixtral" in str(exc.value) and quant.SUPPORTED in str(exc.value)
