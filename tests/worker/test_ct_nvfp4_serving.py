"""compressed-tensors NVFP4 checkpoints (llm-compressor's NVFP4A16 / NVFP4) through DWDP on CPU: sharded logits
== the dequantized-weights model, bitwise, on real rank processes; == the same weights in ModelOpt's form.

Checkpoints: ``ct_nvfp4_reference`` (the tests' own numpy writer, no project code) from seeded synthetic
models — every Linear but the ignored ones (lm_head, routers by ``re:`` pattern, one attention projection by
name) as ``weight_packed`` + ``weight_scale`` + the inverse ``weight_global_scale`` —, their float32 twins
(``(e2m1 · s) · fl32(1 / g)``, computed in float64) and, for the cross-format check, the same codes and scales
in ModelOpt's form with ``weight_scale_2 = fl32(1 / g)``. Sizes as the ModelOpt tests' (hidden 128 = 8 NVFP4
groups, expert FFN 96 = 6).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.worker.ct_nvfp4_reference import write_ct_nvfp4
from tests.worker.oracle_group import assert_ranks_equal_references, one_torch_thread, run_oracle_group

from dwdp_runtime import quant
from dwdp_runtime.layout import peer_ranges
from dwdp_worker.checkpoint.loader import _expert_reader, build_meta_model, load_config
from dwdp_worker.checkpoint.names import CheckpointMap
from dwdp_worker.checkpoint.nvfp4_view import ModeloptView, modelopt_view
from dwdp_worker.checkpoint.quant_loading import dense_reader, quant_config_of, resolve_layout
from dwdp_worker.checkpoint.safetensors_index import CheckpointError, SafetensorsIndex
from dwdp_worker.checkpoint.synth import write_synthetic
from dwdp_worker.launch.oracle import Reference
from dwdp_worker.model.registry import UnsupportedModelError, model_layout

SIZES = dict(hidden_size=128, moe_intermediate_size=96, intermediate_size=128, num_heads=4)
MIXTRAL = dict(hidden_size=128, moe_intermediate_size=96, num_heads=4)
BATCHES = [[[5, 17, 42, 3, 99, 7, 8]], [[1, 2, 3], list(range(10, 47)), [200]], [list(range(0, 256, 3))]]
SHARDING = {2: (5, 3), 3: (3, 3), 4: (3, 2)}  # 8 experts: overlapping / 8 % 3 != 0 / overlapping
#: served at every d
CT = ("qwen3_moe-ct", "deepseek_v3-ct", "mixtral-ct")
#: served at d = 2 beside them: the same weights in ModelOpt's form, and a W4A4 checkpoint of the same weights
AT_D2 = ("qwen3_moe-modelopt", "deepseek_v3-modelopt", "qwen3_moe-w4a4")


class _NoBar:
    def update(self, n: int) -> None:
        pass


@pytest.fixture(scope="module")
def ct_models(tmp_path_factory):
    """name → (checkpoint dir, the twin it must equal, the unquantized original); "<arch>-written" → the
    writer's report (ignore list, quantized modules)."""
    base = tmp_path_factory.mktemp("ctnvfp4")
    out = {}
    for arch, kw, seed in (("qwen3_moe", SIZES, 2), ("deepseek_v3", SIZES, 3), ("mixtral", MIXTRAL, 4)):
        orig = write_synthetic(arch, base / f"{arch}-orig", seed=5, **kw)
        w = write_ct_nvfp4(orig, base / f"{arch}-ct", base / f"{arch}-twin", seed=seed,
                           modelopt_dir=base / f"{arch}-modelopt")
        out[f"{arch}-ct"] = (w["ct"], w["twin"], orig)
        out[f"{arch}-modelopt"] = (w["modelopt"], w["twin"], orig)
        out[f"{arch}-written"] = w
    # W4A4 (input_activations + input_global_scale) of the very same weights: the writer draws nothing more
    w4a4 = write_ct_nvfp4(out["qwen3_moe-ct"][2], base / "qwen3_moe-w4a4", None, seed=2, w4a4=True)
    out["qwen3_moe-w4a4"] = (w4a4["ct"], out["qwen3_moe-ct"][1], out["qwen3_moe-ct"][2])
    return out


@pytest.fixture(scope="module")
def references(ct_models):
    with one_torch_thread():
        out, twins = {}, {}
        for name in CT + AT_D2:
            _, twin, orig = ct_models[name]
            if twin not in twins:
                twins[twin] = [Reference(twin).logits(b) for b in BATCHES]
                # the checkpoint really is quantized: the dequantized model is not the original one
                assert not torch.equal(Reference(orig).logits(BATCHES[0]), twins[twin][0])
            out[name] = twins[twin]
        return out


def _resolve(model_dir):
    config = load_config(model_dir)
    model = build_meta_model(config, torch.float32)
    qc = quant_config_of(config)
    with SafetensorsIndex(model_dir) as index:
        ckpt = modelopt_view(index, qc)
        layout, quantized = resolve_layout(model_layout(model), qc, CheckpointMap.build(model, ckpt.entries), ckpt)
    return layout, quantized, ckpt


def test_ct_checkpoint_is_what_llm_compressor_writes(ct_models):
    """The writer's files have compressed-tensors' names, dtypes and shapes (the format the loader must read)."""
    from safetensors import safe_open

    q = ct_models["deepseek_v3-ct"][0]
    qc = json.loads((q / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert qc["config_groups"]["group_0"]["input_activations"] is None
    with safe_open(str(q / "model.safetensors"), "pt") as f:
        def info(k):
            s = f.get_slice(k)
            return s.get_dtype(), s.get_shape()
        e = "model.layers.1.mlp.experts.3.gate_proj"
        assert info(f"{e}.weight_packed") == ("U8", [96, 64])
        assert info(f"{e}.weight_scale") == ("F8_E4M3", [96, 8])
        assert info(f"{e}.weight_global_scale") == ("F32", [1])
        assert f"{e}.weight" not in f.keys() and f"{e}.weight_scale_2" not in f.keys()
        assert info("model.layers.0.self_attn.q_a_proj.weight_packed")[0] == "U8"      # dense: quantized
        for unq in ("model.layers.1.mlp.gate.weight", "lm_head.weight", "model.layers.0.self_attn.o_proj.weight"):
            assert info(unq)[0] == "F32", unq                                             # ignored
    w4a4 = json.loads((ct_models["qwen3_moe-w4a4"][0] / "config.json").read_text())["quantization_config"]
    assert w4a4["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"


@pytest.mark.parametrize("d", sorted(SHARDING))
def test_ct_nvfp4_sharded_logits_equal_dequantized_reference(d, ct_models, references):
    """qwen3_moe, deepseek_v3 and mixtral in compressed-tensors NVFP4 at d = 2, 3, 4: every rank's logits are the
    dequantized twin's bitwise; at d = 2 the ModelOpt form of the same weights and the W4A4 checkpoint give the
    very same logits, and the ranks prefetch the same (FP4) bytes for the CT and the ModelOpt form."""
    k, s = SHARDING[d]
    names = list(CT) + (list(AT_D2) if d == 2 else [])
    runs = [(f"{n}-d{d}", str(ct_models[n][0]), k, s, None) for n in names]
    res = run_oracle_group(d, runs, BATCHES, harness_timeout_s=420)
    ranges = peer_ranges(dwdp_size=d, num_experts=8, num_experts_per_worker=k, num_prefetch_experts=s)
    assert_ranks_equal_references(res, names, d, references, ranges)
    if d != 2:
        return
    for arch in ("qwen3_moe", "deepseek_v3"):
        for rank, value in res.items():
            ct, mo = value[f"{arch}-ct-d2"], value[f"{arch}-modelopt-d2"]
            assert all(np.array_equal(a, b) for a, b in zip(ct["logits"], mo["logits"])), (arch, rank)
            moved = ct["stats"].remote_bytes_per_forward
            assert moved == mo["stats"].remote_bytes_per_forward > 0, (arch, rank)
    layout, _, _ = _resolve(ct_models["qwen3_moe-ct"][0])
    per_expert = sum(p.numel * torch.empty((), dtype=p.dtype).element_size() for p in layout.experts[0].params)
    a, b = ranges[d - 1]   # the rank whose local range ends on a page pulls exactly the experts it lacks
    pulled = res[d - 1]["qwen3_moe-ct-d2"]["stats"].remote_bytes_per_forward
    print(f"qwen3_moe CT NVFP4: rank {d - 1} pulls {pulled} B per forward, {per_expert} B per expert per layer")
    assert pulled == (8 - (b - a)) * per_expert * len(layout.experts)


def test_ct_layout_is_modelopts_read_from_ct_keys(ct_models):
    """The sharded tensors of a CT checkpoint are declared exactly as the ModelOpt form's (same names, shapes,
    dtypes: one ``NVFP4_SCHEME``); the bytes behind them are the CT checkpoint's own keys."""
    ct_layout, ct_q, ckpt = _resolve(ct_models["qwen3_moe-ct"][0])
    mo_layout, mo_q, _ = _resolve(ct_models["qwen3_moe-modelopt"][0])
    assert isinstance(ckpt, ModeloptView)

    def decl(layout):
        return [[(p.name, p.role, tuple(p.expert_shape), p.dtype, p.source) for p in e.params] for e in layout.experts]

    assert decl(ct_layout) == decl(mo_layout)     # sources too: under ModelOpt's names
    assert ct_q == mo_q
    e = ct_layout.experts[0]
    stored = {p.name: ckpt.stored_key(p.source.parts[0][0]) for p in e.params}
    assert stored == {"gate_up_proj": "model.layers.0.mlp.experts.0.gate_proj.weight_packed",
                      "gate_up_proj_weight_scale": "model.layers.0.mlp.experts.0.gate_proj.weight_scale",
                      "gate_up_proj_weight_scale_2": "model.layers.0.mlp.experts.0.gate_proj.weight_global_scale",
                      "down_proj": "model.layers.0.mlp.experts.0.down_proj.weight_packed",
                      "down_proj_weight_scale": "model.layers.0.mlp.experts.0.down_proj.weight_scale",
                      "down_proj_weight_scale_2": "model.layers.0.mlp.experts.0.down_proj.weight_global_scale"}
    assert ct_q[e.path].projection("gate_up_proj").row_segments == (96, 96)


def test_rank_reads_only_its_experts_bytes(ct_models):
    """For each rank of a d = 4 group, filling its local experts of every sharded tensor reads exactly those
    experts' bytes from the CT checkpoint (the index's own byte count), and gives what the ModelOpt form holds:
    the same packed codes and e4m3 scales, ``weight_scale_2 = fl32(1 / weight_global_scale)``."""
    ct_dir, mo_dir = ct_models["deepseek_v3-ct"][0], ct_models["deepseek_v3-modelopt"][0]
    layout, _, _ = _resolve(ct_dir)
    mo_layout, _, _ = _resolve(mo_dir)
    qc, mo_qc = quant_config_of(load_config(ct_dir)), quant_config_of(load_config(mo_dir))
    ranges = peer_ranges(dwdp_size=4, num_experts=8, num_experts_per_worker=3, num_prefetch_experts=2)
    with SafetensorsIndex(ct_dir) as index, SafetensorsIndex(mo_dir) as mo_index:
        ckpt, mo_ckpt = modelopt_view(index, qc), modelopt_view(mo_index, mo_qc)
        assert mo_ckpt is mo_index   # ModelOpt's names: no view
        for experts, mo_experts in zip(layout.experts, mo_layout.experts):
            for p, mo_p in zip(experts.params, mo_experts.params):
                item = torch.empty((), dtype=p.dtype).element_size()
                for a, b in ranges:
                    got = torch.empty((b - a, *p.expert_shape), dtype=p.dtype)
                    before = index.bytes_read
                    _expert_reader(ckpt, experts, p, _NoBar())(got, a, b)
                    assert index.bytes_read - before == (b - a) * p.numel * item, (p.name, a, b)
                    want = torch.empty_like(got)
                    _expert_reader(mo_ckpt, mo_experts, mo_p, _NoBar())(want, a, b)
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (experts.path, p.name, a, b)


def test_dense_ct_linears_are_dequantized_like_modelopts(ct_models):
    """Attention, dense MLPs and shared experts (replicated) read from the CT checkpoint are the twin's float32
    weights, bitwise; the ignored ones stay as stored."""
    from safetensors.torch import load_file

    for arch in ("deepseek_v3", "qwen3_moe"):
        ct_dir, twin, _ = ct_models[f"{arch}-ct"]
        written = ct_models[f"{arch}-written"]
        want = load_file(str(twin / "model.safetensors"))
        dense = [m for m in written["quantized"] if ".experts." not in m]
        assert dense, arch
        with SafetensorsIndex(ct_dir) as index:
            read = dense_reader(modelopt_view(index, quant_config_of(load_config(ct_dir))))
            for m in dense + ["model.layers.0.self_attn.o_proj", "lm_head"]:
                assert torch.equal(read(f"{m}.weight"), want[f"{m}.weight"]), m


def _edit(src, dst, *, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg["quantization_config"])
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = load_file(str(dst / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_ct_checkpoint_that_contradicts_itself_is_refused(ct_models, tmp_path):
    src = ct_models["qwen3_moe-ct"][0]
    e = "model.layers.2.mlp.experts.3.up_proj"

    bad = _edit(src, tmp_path / "ignored", config=lambda qc: qc["ignore"].append(r"re:.*\.2\.mlp\.experts\.3\.up_proj$"))
    with pytest.raises(CheckpointError, match=rf"{e}.weight_packed: stored as compressed-tensors NVFP4, but "
                                              rf"quantization_config.ignore lists {e}"):
        _resolve(bad)

    def both(t):
        t[f"{e}.weight"] = torch.zeros(96, 128)

    bad = _edit(src, tmp_path / "both", tensors=both)
    with pytest.raises(CheckpointError, match=rf"are both {e}.weight under ModelOpt's NVFP4 names"):
        _resolve(bad)

    def f32_scale(t):
        t[f"{e}.weight_scale"] = t[f"{e}.weight_scale"].to(torch.float32)

    bad = _edit(src, tmp_path / "scale", tensors=f32_scale)
    with pytest.raises(CheckpointError, match=rf"{e}.weight_scale: stored as float32.*float8_e4m3fn"):
        _resolve(bad)

    def zero_global(t):
        t[f"{e}.weight_global_scale"] = torch.zeros(1)
        t["model.layers.0.self_attn.q_proj.weight_global_scale"] = torch.zeros(1)

    bad = _edit(src, tmp_path / "zero", tensors=zero_global)
    layout, _, ckpt = _resolve(bad)
    experts = next(x for x in layout.experts if x.path == "model.layers.2.mlp.experts")
    p = experts.param("gate_up_proj_weight_scale_2")
    with ckpt.reopened():
        with pytest.raises(CheckpointError, match=rf"{e}.weight_global_scale: compressed-tensors NVFP4 global "
                                                  r"scale 0.0 has no finite inverse"):
            _expert_reader(ckpt, experts, p, _NoBar())(torch.empty(8, 2), 0, 8)
        with pytest.raises(CheckpointError, match="q_proj.weight_global_scale: .* no finite inverse"):
            dense_reader(ckpt)("model.layers.0.self_attn.q_proj.weight")


@pytest.mark.parametrize("change, says", [
    (lambda qc: qc.update(format="pack-quantized"), "format 'pack-quantized' is not supported"),
    (lambda qc: qc["config_groups"]["group_0"].update(format="mxfp4-pack-quantized"),
     "format 'mxfp4-pack-quantized'"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits=8, type="int"), "num_bits 8"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(group_size=32), "group_size 32"),
    (lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "float",
                                                                         "strategy": "token", "dynamic": True}),
     r"input_activations.num_bits 8"),
    (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     "sparsity_config"),
])
def test_unsupported_ct_configs_are_refused_at_load(ct_models, tmp_path, change, says):
    bad = _edit(ct_models["qwen3_moe-ct"][0], tmp_path / "bad", config=change)
    with pytest.raises(UnsupportedModelError, match=says) as exc:
        load_config(bad)
    assert "qwen3_moe" in str(exc.value) and quant.SUPPORTED in str(exc.value)


def test_unsharded_model_with_bound_ct_experts_is_the_dequantized_model(ct_models, references):
    """``bind_quantized_experts`` (the unsharded baseline of the GPU tests and benches) reads a CT checkpoint too:
    the twin's model with the CT checkpoint's packed experts bound computes the twin's logits."""
    from dwdp_worker.checkpoint.fp8 import bind_quantized_experts

    torch.set_num_threads(1)
    q, twin, _ = ct_models["mixtral-ct"]
    ref = Reference(twin)
    attachment = bind_quantized_experts(ref.model, q, "cpu", torch.float32)
    try:
        experts = ref.model.get_submodule(model_layout(ref.model).experts[0].path)
        assert experts.gate_up_proj.dtype == torch.uint8
        for b, want in zip(BATCHES, references["mixtral-ct"]):
            assert torch.equal(ref.logits(b), want)
    finally:
        attachment.close()
