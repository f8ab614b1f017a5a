"""FP4 checkpoints (MXFP4 as gpt-oss, NVFP4 as ModelOpt) through DWDP on CPU: sharded logits == the
dequantized-weights model, bitwise, on real rank processes.

Checkpoints, two writers:
  * ``fp4_reference`` (the tests' own converter, independent of DWDP's): random E2M1 codes and exactly
    representable scales, with a float32 twin holding the same numbers — plain `transformers` on the twin is
    the reference, no rounding convention shared with the production code; for gpt-oss also
    `transformers`' own MXFP4 dequantize (``Mxfp4Config(dequantize=True)``) of the FP4 checkpoint;
  * ``dwdp-worker synth --quant mxfp4|nvfp4`` (the production writer), against its dequantized twin
    (``checkpoint.fp4.dequantize_checkpoint``) and, for MXFP4, against `transformers`' dequantize too.
Sizes make the groups real (hidden 128 = 8 NVFP4 groups = 4 MXFP4 groups; expert FFN 96 = 6 / 3).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.runtime.group import run_group
from tests.worker.fp4_reference import write_mxfp4, write_nvfp4, write_ue8m0
from tests.worker.oracle_group import assert_ranks_equal_references, one_torch_thread, run_oracle_group
from tests.worker.programs import memory_program

from dwdp_runtime import quant
from dwdp_runtime.layout import peer_ranges
from dwdp_worker.checkpoint.fp4 import dequantize_checkpoint
from dwdp_worker.checkpoint.loader import build_meta_model, load_config
from dwdp_worker.checkpoint.names import CheckpointMap
from dwdp_worker.checkpoint.quant_loading import quant_config_of, resolve_layout
from dwdp_worker.checkpoint.safetensors_index import CheckpointError, SafetensorsIndex
from dwdp_worker.checkpoint.synth import write_synthetic
from dwdp_worker.launch.oracle import Reference, realign
from dwdp_worker.model.packing import packed_logits
from dwdp_worker.model.registry import UnsupportedModelError, model_layout

GPT_OSS = dict(config_overrides=dict(intermediate_size=96, hidden_size=128, head_dim=32))
SIZES = dict(hidden_size=128, moe_intermediate_size=96, intermediate_size=128, num_heads=4)
BATCHES = [[[5, 17, 42, 3, 99, 7, 8]], [[1, 2, 3], list(range(10, 47)), [200]], [list(range(0, 256, 3))]]
SHARDING = {2: (5, 3), 3: (3, 3), 4: (3, 2)}  # 8 experts: overlapping / 8 % 3 != 0 / overlapping
#: the independent writer's checkpoints, served at every d; the synth ones and variants at d = 2
INDEPENDENT = ("gpt_oss-mxfp4", "qwen3_moe-nvfp4", "deepseek_v3-nvfp4", "deepseek_v4-fp4")
AT_D2 = ("gpt_oss-synth", "deepseek_v3-synth", "deepseek_v4-synth", "qwen3_moe-hf_quant_config",
         "deepseek_v3-synth@bfloat16")
#: also served with DWDP_FP8_DENSE=on: synth's DeepSeek-V4 stores its dense linears FP8 with E8M0 block scales
#: (the independent writer keeps them as saved: nothing to keep, the same logits)
V4_FP8_DENSE = ("deepseek_v4-fp4", "deepseek_v4-synth")
MiB = 2**20


def transformers_mxfp4(model_dir, dtype=torch.float32):
    """`transformers`' own MXFP4 load on CPU: ``Mxfp4Config(dequantize=True)`` (its ``convert_moe_packed_tensors``)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    realign(model)
    return model


@pytest.fixture(scope="module")
def fp4_models(tmp_path_factory):
    """name -> (FP4 checkpoint, its reference: the float twin / the dequantized twin, the unquantized original)."""
    base = tmp_path_factory.mktemp("fp4")
    gpt = write_synthetic("gpt_oss", base / "gpt_oss-orig", seed=5, **GPT_OSS)
    qwen = write_synthetic("qwen3_moe", base / "qwen3_moe-orig", seed=5, **SIZES)
    dsv3 = write_synthetic("deepseek_v3", base / "deepseek_v3-orig", seed=5, **SIZES)
    dsv4 = write_synthetic("deepseek_v4", base / "deepseek_v4-orig", seed=5)   # synth_config's tiny V4
    out = {
        "gpt_oss-mxfp4": (*write_mxfp4(gpt, base / "gpt_oss-mxfp4", base / "gpt_oss-mxfp4-twin", seed=1), gpt),
        "qwen3_moe-nvfp4": (*write_nvfp4(qwen, base / "qwen3_moe-nvfp4", base / "qwen3_moe-nvfp4-twin", seed=2), qwen),
        "deepseek_v3-nvfp4": (*write_nvfp4(dsv3, base / "dsv3-nvfp4", base / "dsv3-nvfp4-twin", seed=3), dsv3),
        "deepseek_v4-fp4": (*write_ue8m0(dsv4, base / "dsv4-fp4", base / "dsv4-fp4-twin", seed=6), dsv4),
        "qwen3_moe-hf_quant_config": (*write_nvfp4(qwen, base / "qwen3-hfq", base / "qwen3-hfq-twin", seed=4,
                                                   hf_quant_config_json=True), qwen),
    }
    for name, arch, kw, fmt, orig in [("gpt_oss-synth", "gpt_oss", GPT_OSS, "mxfp4", gpt),
                                      ("deepseek_v3-synth", "deepseek_v3", SIZES, "nvfp4", dsv3),
                                      ("deepseek_v4-synth", "deepseek_v4", {}, "fp4-ue8m0", dsv4)]:
        q = write_synthetic(arch, base / name, seed=5, quant=fmt, **kw)
        out[name] = (q, dequantize_checkpoint(q, base / f"{name}-twin"), orig)
    return out


@pytest.fixture(scope="module")
def references(fp4_models):
    with one_torch_thread():
        out = {}
        for name, (_, twin, orig) in fp4_models.items():
            out[name] = [Reference(twin).logits(b) for b in BATCHES]
            # the checkpoint really is quantized: the dequantized model is not the original one
            assert not torch.equal(Reference(orig).logits(BATCHES[0]), out[name][0])
        out["deepseek_v3-synth@bfloat16"] = [Reference(fp4_models["deepseek_v3-synth"][1], dtype="bfloat16").logits(b)
                                             for b in BATCHES]
        return out


def test_independent_mxfp4_twin_is_what_transformers_dequantizes(fp4_models, references):
    """The tests' packer and `transformers`' MXFP4 dequantize agree (nibble order, E8M0, the [out, in] → [in, out]
    layout, gate/up interleave): logits of `transformers`' load of the FP4 checkpoint == those of the twin."""
    torch.set_num_threads(1)
    for name in ("gpt_oss-mxfp4", "gpt_oss-synth"):
        model = transformers_mxfp4(fp4_models[name][0])
        for b, want in zip(BATCHES, references[name]):
            assert torch.equal(packed_logits(model, b, torch.device("cpu")), want), name


def test_synth_mxfp4_experts_are_what_transformers_reads(fp4_models):
    """DWDP's production packer (``synth --quant mxfp4``) writes the tensors gpt-oss's loader expects."""
    from safetensors.torch import load_file

    q, twin, _ = fp4_models["gpt_oss-synth"]
    model = transformers_mxfp4(q)
    ours = load_file(str(twin / "model.safetensors"))
    sd = model.state_dict()
    keys = [k for k in ours if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(keys) == 2 * model.config.num_hidden_layers
    for k in keys:
        assert torch.equal(sd[k], ours[k]), k


def test_deepseek_v4_twins_are_what_transformers_dequantizes(fp4_models):
    """`transformers`' own DeepSeek-V4 dequantization (``Fp8Dequantize._dequantize_one``, the op its FP8 quantizer
    runs for ``dequantize=True``: FP4 experts with E8M0 scales, FP8 dense with E8M0 block scales) of every
    quantized tensor equals the twins' (the tests' writer and DWDP's synth)."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    op = Fp8Dequantize(None)
    for name, kinds in (("deepseek_v4-fp4", {torch.int8}), ("deepseek_v4-synth", {torch.int8, torch.float8_e4m3fn})):
        q, twin, _ = fp4_models[name]
        tensors, want = load_file(str(q / "model.safetensors")), load_file(str(twin / "model.safetensors"))
        quantized = {k: v for k, v in tensors.items() if v.dtype in (torch.int8, torch.float8_e4m3fn)}
        assert {v.dtype for v in quantized.values()} == kinds, name
        for key, value in quantized.items():
            scale = tensors[key.removesuffix(".weight") + ".scale"]
            assert torch.equal(op._dequantize_one(value, scale, torch.float32), want[key]), (name, key)


def test_fp4_checkpoint_formats(fp4_models):
    from safetensors import safe_open

    q, _, _ = fp4_models["gpt_oss-synth"]
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        def info(k):
            s = f.get_slice(k)
            return s.get_dtype(), s.get_shape()
        e = "model.layers.0.mlp.experts"
        assert info(f"{e}.gate_up_proj_blocks") == ("U8", [8, 192, 4, 16])    # [E, 2I, H/32, 16]
        assert info(f"{e}.gate_up_proj_scales") == ("U8", [8, 192, 4])
        assert info(f"{e}.down_proj_blocks") == ("U8", [8, 128, 3, 16])       # [E, H, I/32, 16]
        assert info(f"{e}.gate_up_proj_bias")[0] == "F32"
        assert "model.layers.0.self_attn.q_proj.weight" in f.keys()
    q, _, _ = fp4_models["deepseek_v3-synth"]
    cfg = json.loads((q / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                          "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        def info(k):
            s = f.get_slice(k)
            return s.get_dtype(), s.get_shape()
        e = "model.layers.1.mlp.experts.3"
        assert info(f"{e}.gate_proj.weight") == ("U8", [96, 64])
        assert info(f"{e}.gate_proj.weight_scale") == ("F8_E4M3", [96, 8])
        assert info(f"{e}.gate_proj.weight_scale_2") == ("F32", [])
        assert info(f"{e}.gate_proj.input_scale") == ("F32", [])
        assert info("model.layers.0.self_attn.q_b_proj.weight")[0] == "U8"      # dense: quantized
        for unq in ("model.layers.1.mlp.gate.weight", "lm_head.weight", "model.embed_tokens.weight"):
            assert info(unq)[0] == "F32", unq


@pytest.mark.parametrize("d", sorted(SHARDING))
def test_fp4_sharded_logits_equal_dequantized_reference(d, fp4_models, references):
    k, s = SHARDING[d]
    names = list(INDEPENDENT) + (list(AT_D2) if d == 2 else [])
    dense_fp8 = list(V4_FP8_DENSE) if d == 2 else []

    def run(n, tag):
        return f"{n}-{tag}", str(fp4_models[n.split("@")[0]][0]), k, s, n.split("@")[1] if "@" in n else None
    runs = [run(n, f"d{d}") for n in names] + [run(n, "fp8dense") for n in dense_fp8]
    res = run_oracle_group(d, runs, BATCHES, harness_timeout_s=420,
                           env={f"{n}-fp8dense": {"DWDP_FP8_DENSE": "on"} for n in dense_fp8})
    ranges = peer_ranges(dwdp_size=d, num_experts=8, num_experts_per_worker=k, num_prefetch_experts=s)
    assert_ranks_equal_references(res, names, d, references, ranges)
    if d == 2:
        _assert_prefetch_moves_fp4_bytes(fp4_models, res, ranges, d)
        # DeepSeek-V4's dense FP8 linears (E8M0 block scales) kept FP8 (DWDP_FP8_DENSE=on): the same logits
        kept = {r: {f"{n}-d{d}": v[f"{n}-fp8dense"] for n in dense_fp8} for r, v in res.items()}
        assert_ranks_equal_references(kept, dense_fp8, d, references, ranges)
        for name in dense_fp8:
            for jobs in res.values():
                on, off = jobs[f"{name}-fp8dense"], jobs[f"{name}-d{d}"]
                assert not off["fp8_linears"], name
                if name == "deepseek_v4-synth":
                    assert any(n.endswith("self_attn.o_b_proj") for n in on["fp8_linears"]), on["fp8_linears"]
                    assert on["dense_bytes"] < off["dense_bytes"], name
                else:
                    assert not on["fp8_linears"] and on["dense_bytes"] == off["dense_bytes"], name


def _assert_prefetch_moves_fp4_bytes(fp4_models, res, ranges, d):
    """What the ranks copied per forward (the runtime's own count) is the packed FP4 bytes of the experts they
    lack — a quarter of bf16 —: at most (E − local) × the declared bytes per expert per MoE layer (the head of a
    peer's expert sharing the local handle's last page is filled once at setup), and exactly that on a rank
    whose local range ends on a page (rank d − 1 here)."""
    for name in ("qwen3_moe-nvfp4", "gpt_oss-mxfp4", "deepseek_v4-fp4"):
        layout, _ = _resolve(fp4_models[name][0])
        per_expert = sum(p.numel * torch.empty((), dtype=p.dtype).element_size() for p in layout.experts[0].params)
        moved = {rank: value[f"{name}-d{d}"]["stats"].remote_bytes_per_forward for rank, value in res.items()}
        bound = {rank: (8 - (b - a)) * per_expert * len(layout.experts) for rank, (a, b) in enumerate(ranges)}
        print(f"{name}: remote bytes per forward {moved}, FP4 bound {bound}, bytes per expert {per_expert}")
        assert all(0 < moved[r] <= bound[r] for r in moved), (moved, bound)
        assert moved[d - 1] == bound[d - 1]


@pytest.fixture(scope="module")
def big_nvfp4(tmp_path_factory):
    # bf16: the dense weights (dequantized at load) stay small next to ~96 MiB of NVFP4 experts (2 MoE layers);
    # the independent writer (random codes) is fast where quantizing 200 M weights is not
    base = tmp_path_factory.mktemp("fp4mem")
    orig = write_synthetic("qwen3_moe", base / "orig", seed=3, num_experts=32, num_layers=3, hidden_size=512,
                           moe_intermediate_size=2048, intermediate_size=256, vocab_size=256, dtype="bfloat16")
    return write_nvfp4(orig, base / "q", None, seed=3)[0]


def test_nvfp4_rank_reads_only_its_packed_experts_and_scales(big_nvfp4):
    """The page pool and the local handles hold FP4 bytes: a rank's share of the packed experts and scales."""
    res = run_group(memory_program, 4, fresh_interpreters=True, model_dir=str(big_nvfp4), k=8, s=8,
                    harness_timeout_s=180)
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    h, i = 512, 2048
    packed = 2 * i * h // 2 + h * i // 2                              # gate_up [2I, H/2] + down [H, I/2] bytes
    scales = 2 * i * (h // 16) + 2 * 4 + h * (i // 16) + 4            # e4m3 group scales + fp32 global scales
    for rank, (_, r) in sorted(res.items()):
        total, local, dense, peak = r["total_expert_bytes"], r["local_expert_bytes"], r["dense_bytes"], r["peak_growth"]
        assert total == 32 * 2 * (packed + scales) and local == total // 4
        assert r["local_scale_bytes"] == 8 * 2 * scales                # 8 local experts x 2 MoE layers
        print(f"rank {rank}: peak growth {peak / MiB:.1f} MiB, local experts {local / MiB:.1f} MiB "
              f"(scales {r['local_scale_bytes']} B), dense {dense / MiB:.1f} MiB, all experts {total / MiB:.1f} MiB")
        assert peak <= dense + 2 * r["largest_local_weight"] + 8 * MiB, (rank, peak / MiB)
        assert peak < total / 2, (rank, peak / MiB)   # the local handles count in the peak (host backend)
        mapped, handles = r["mapped"], r["handles"]
        assert (mapped.weights, mapped.scales, mapped.pool) == (handles["weights"], handles["scales"], handles["pool"])
        assert 0 < mapped.scales < mapped.weights


def _resolve(model_dir):
    config = load_config(model_dir)
    model = build_meta_model(config, torch.float32)
    with SafetensorsIndex(model_dir) as ckpt:
        return resolve_layout(model_layout(model), quant_config_of(config), CheckpointMap.build(model, ckpt.entries),
                              ckpt)


def test_fp4_layout_declares_packed_experts(fp4_models):
    layout, quantized = _resolve(fp4_models["gpt_oss-mxfp4"][0])
    e = layout.experts[0]
    shapes = {p.name: (p.role.value, tuple(p.expert_shape), str(p.dtype)) for p in e.params}
    assert shapes == {"gate_up_proj": ("weight", (192, 4, 16), "torch.uint8"),
                      "gate_up_proj_scales": ("scale", (192, 4), "torch.uint8"),
                      "gate_up_proj_bias": ("bias", (192,), "torch.float32"),
                      "down_proj": ("weight", (128, 3, 16), "torch.uint8"),
                      "down_proj_scales": ("scale", (128, 3), "torch.uint8"),
                      "down_proj_bias": ("bias", (128,), "torch.float32")}
    assert all(p.transposed for p in quantized[e.path].projections)
    layout, quantized = _resolve(fp4_models["qwen3_moe-nvfp4"][0])
    e = layout.experts[0]
    shapes = {p.name: (tuple(p.expert_shape), str(p.dtype)) for p in e.params}
    assert shapes == {"gate_up_proj": ((192, 64), "torch.uint8"), "down_proj": ((128, 48), "torch.uint8"),
                      "gate_up_proj_weight_scale": ((192, 8), "torch.float8_e4m3fn"),
                      "gate_up_proj_weight_scale_2": ((2,), "torch.float32"),
                      "down_proj_weight_scale": ((128, 6), "torch.float8_e4m3fn"),
                      "down_proj_weight_scale_2": ((1,), "torch.float32")}
    assert quantized[e.path].projection("gate_up_proj").row_segments == (96, 96)
    layout, quantized = _resolve(fp4_models["deepseek_v4-fp4"][0])
    e = layout.experts[0]
    shapes = {p.name: (tuple(p.expert_shape), str(p.dtype)) for p in e.params}
    assert shapes == {"gate_up_proj": ((64, 32), "torch.int8"), "down_proj": ((64, 16), "torch.int8"),
                      "gate_up_proj_scale_inv": ((64, 2), "torch.float8_e8m0fnu"),
                      "down_proj_scale_inv": ((64, 1), "torch.float8_e8m0fnu")}
    assert e.param("gate_up_proj_scale_inv").source.parts[0][0].endswith("experts.0.w1.scale")  # DeepSeek's name


def _rewrite(src, dst, edit):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_wrong_scale_dtype_is_refused_at_load(fp4_models, tmp_path):
    key = "model.layers.2.mlp.experts.2.up_proj.weight_scale"

    def to_f32(t):
        t[key] = t[key].to(torch.float32)

    bad = _rewrite(fp4_models["qwen3_moe-nvfp4"][0], tmp_path / "bad", to_f32)
    with pytest.raises(CheckpointError, match=f"{key}: stored as float32.*float8_e4m3fn"):
        _resolve(bad)

    def drop_scales(t):
        del t["model.layers.0.mlp.experts.down_proj_scales"]

    bad = _rewrite(fp4_models["gpt_oss-mxfp4"][0], tmp_path / "bad-mx", drop_scales)
    with pytest.raises(CheckpointError, match="lacks model.layers.0.mlp.experts.down_proj_scales"):
        _resolve(bad)


def test_nvfp4_of_transposed_experts_is_refused(tmp_path):
    with pytest.raises(ValueError, match="NVFP4 needs per-expert"):
        write_synthetic("gpt_oss", tmp_path / "g", seed=1, quant="nvfp4", **GPT_OSS)


@pytest.mark.parametrize("change, says", [
    ({"quant_algo": "FP8"}, "quant_algo 'FP8' is not supported"),
    ({"group_size": 32}, "group_size 32 is not supported"),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors config_groups None"),   # served: NVFP4 groups only
])
def test_bad_nvfp4_config_is_refused_at_load(fp4_models, tmp_path, change, says):
    dst = tmp_path / "bad"
    shutil.copytree(fp4_models["qwen3_moe-nvfp4"][0], dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=says) as exc:
        load_config(dst)
    assert "qwen3_moe" in str(exc.value) and quant.SUPPORTED in str(exc.value)


def test_nvfp4_and_mxfp4_serve_over_http_like_the_dequantized_model(fp4_models, tmp_path):
    """A local group (1 × 2 ranks, the real launcher and HTTP front) on each FP4 checkpoint of the independent
    writer: greedy completions and their log-probabilities are those of plain `transformers` on the twin."""
    from dwdp_worker.checkpoint.synth import write_tokenizer

    from .serving_helpers import Server, greedy_reference

    prompt = [5, 17, 42, 99, 3]
    for name in ("qwen3_moe-nvfp4", "gpt_oss-mxfp4"):
        q, twin, _ = fp4_models[name]
        served = tmp_path / name
        shutil.copytree(q, served)
        write_tokenizer(served, vocab_size=json.loads((q / "config.json").read_text())["vocab_size"])
        ids, lps, _ = greedy_reference(twin, prompt, 3)
        srv = Server(["--local", "--model", str(served), "--groups", "1", "--dwdp-size", "2", "--backend", "host",
                      "--max-num-tokens", "48", "--served-model-name", name])
        try:
            srv.wait_for("/readyz", timeout_s=180)
            r = srv.post({"prompt": prompt, "max_tokens": 3, "logprobs": 1})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == ids, name
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=1e-4)
        finally:
            srv.close()


def test_unsharded_model_with_bound_fp4_experts_is_the_dequantized_model(fp4_models, references):
    """``bind_quantized_experts`` (the unsharded baseline of the GPU tests and benches): the twin's model with the
    FP4 composites of the checkpoint bound as plain tensors computes the twin's logits."""
    from dwdp_worker.checkpoint.fp8 import bind_quantized_experts

    torch.set_num_threads(1)
    for name in ("qwen3_moe-nvfp4", "gpt_oss-mxfp4"):
        q, twin, _ = fp4_models[name]
        ref = Reference(twin)
        attachment = bind_quantized_experts(ref.model, q, "cpu", torch.float32)
        experts = ref.model.get_submodule(model_layout(ref.model).experts[0].path)
        assert experts.gate_up_proj.dtype == torch.uint8
        for b, want in zip(BATCHES, references[name]):
            assert torch.equal(ref.logits(b), want), name
        attachment.close()
