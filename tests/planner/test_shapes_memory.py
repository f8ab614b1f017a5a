"""config.json parsing and the per-GPU memory breakdown, by hand."""

import json

import pytest

from dwdp_runtime.planner import memory
from dwdp_runtime.planner.model_shapes import ModelConfigError, from_hf_config, load_model
from dwdp_runtime.planner.presets import DTYPES, GIB, MIB
from dwdp_runtime.planner.prefetch import expert_ranges

from .planner_toy import TOY, TOY_CONFIG, toy_gpu


def test_deepseek_preset_fields():
    m = load_model("DeepSeek-R1")
    assert m.is_mla and m.num_experts == 256 and m.top_k == 8 and m.moe_inter == 2048
    assert m.moe_layers == tuple(range(3, 61))                     # first_k_dense_replace = 3
    assert m.expert_params == 3 * 7168 * 2048
    assert m.qk_dim == 128 + 64 and m.v_dim == 128
    assert m.shared_inter == 2048                                   # 1 shared expert
    assert m.kv_bytes_per_token() == (512 + 64) * 61 * 2            # MLA latent + rope key, bf16


def test_qwen_sparse_step_and_mlp_only_layers():
    cfg = {"hidden_size": 8, "num_hidden_layers": 6, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 4, "intermediate_size": 16, "num_attention_heads": 2,
           "num_key_value_heads": 1, "vocab_size": 10, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    m = from_hf_config(cfg)
    # (i + 1) % 2 == 0 -> 1, 3, 5; minus mlp_only 3 -> (1, 5)
    assert m.moe_layers == (1, 5) and m.head_dim == 4 and m.kv_bytes_per_token() == 2 * 1 * 4 * 6 * 2


def test_mixtral_every_layer_moe():
    m = load_model("mixtral-8x22b")
    assert m.num_moe_layers == 56 and m.num_experts == 8 and m.moe_inter == 16384 and not m.is_mla


def test_config_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="no routed experts"):
        from_hf_config({"hidden_size": 8, "num_hidden_layers": 1, "num_experts_per_tok": 1,
                        "num_attention_heads": 1, "vocab_size": 2})
    with pytest.raises(ModelConfigError, match="neither a preset"):
        load_model(str(tmp_path / "missing.json"))
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read JSON"):
        load_model(str(tmp_path))
    bad.write_text(json.dumps(dict(TOY_CONFIG, num_experts_per_tok=5)))
    with pytest.raises(ModelConfigError, match="num_experts_per_tok=5"):
        load_model(str(bad))


def test_toy_dense_weight_bytes():
    # embedding 4x2 + lm_head 4x2 (untied) bf16 = 32 B, final norm 2 x 2 B = 4 B
    # layer: 4 projections of 2x2 bf16 = 32 B, 2 norms = 8 B, router 2x2 bf16 = 8 B -> total 84 B
    b = memory.dense_weight_bytes(TOY, dtype=DTYPES["bf16"], dense_dtype=DTYPES["bf16"])
    assert b == 84


def _shape(**over):
    cfg = {"hidden_size": 1024, "num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2,
           "intermediate_size": 1024, "num_attention_heads": 8, "vocab_size": 16}
    cfg.update(over)
    return from_hf_config(cfg)


def test_local_experts_and_pool_pages_by_hand():
    """H = I = 1024, bf16: one expert is 4 MiB in gate_up (2*I*H*2 B) and 2 MiB in down.
    d = 2, k = s = 4 of 8: ranges (0,4), (4,8). Local per layer: 4*4 + 4*2 = 24 MiB; 3 layers = 72 MiB.
    Pool pages (16 MiB) per layer, rank 0 (a = 0): gate_up: 0 pre, post (8-0)*4 - 16 = 16 MiB -> 1 page;
    down: post 16 - 8 = 8 MiB -> 1 page.  Rank 1 (a = 4): gate_up: ceil(16/16) = 1 pre page, post 0;
    down: ceil(8/16) = 1 pre page.  Worst rank: 2 pages; 2 slots -> 4 pages = 64 MiB."""
    shape = _shape()
    ranges = expert_ranges(dwdp_size=2, num_experts=8, experts_per_worker=4, stride=4)
    assert memory.local_expert_bytes(shape, dtype=DTYPES["bf16"], experts_per_worker=4) == 72 * MIB
    assert memory.pool_slot_bytes(shape, dtype=DTYPES["bf16"], ranges=ranges, slots=2) == 64 * MIB
    assert memory.pool_slot_bytes(shape, dtype=DTYPES["bf16"], ranges=ranges, slots=3) == 96 * MIB


def test_local_experts_round_to_granularity():
    # H = 1024, I = 512, bf16: gate_up expert 2 MiB, down 1 MiB; k = 3: 6 MiB + round_up(3 MiB, 2) = 4 MiB
    shape = _shape(num_hidden_layers=1, intermediate_size=512)
    assert memory.local_expert_bytes(shape, dtype=DTYPES["bf16"], experts_per_worker=3) == 10 * MIB


def test_breakdown_sums_to_capacity():
    ranges = expert_ranges(dwdp_size=2, num_experts=2, experts_per_worker=1, stride=1)
    bd = memory.breakdown(model=TOY, dtype="bf16", hardware=toy_gpu(memory=1 * GIB), ranges=ranges,
                          experts_per_worker=1, prefetch_slots=2, max_num_tokens=3, kv_tokens=3)
    assert bd.used + bd.kv_cache_available == pytest.approx(1 * GIB)
    assert bd.kv_needed == 3 * (2 * 1 * 2 * 1 * 2)   # 3 tokens * K and V, 1 head of 2, 1 layer, bf16


def test_memory_fit_for_the_operator():
    ok, msg, bd = memory.memory_fit(model="qwen3-235b-a22b", dtype="fp8", hardware="h200-hgx", dwdp_size=4,
                                    experts_per_worker=32, prefetch_stride=32, prefetch_slots=2)
    assert ok and msg.startswith("fits:") and bd.kv_cache_available > 0
    # DeepSeek-R1 in bf16 is ~1.3 TB: 64 experts x 58 layers x 88 MB alone exceed a 141 GB H200
    ok, msg, bd = memory.memory_fit(model="deepseek-r1", dtype="bf16", hardware="h200", dwdp_size=4,
                                    experts_per_worker=64, prefetch_stride=64, prefetch_slots=2)
    assert not ok and "does not fit" in msg and "short by" in msg and bd.local_experts > bd.capacity
    ok, msg, bd = memory.memory_fit(model="deepseek-r1", dtype="nvfp4", hardware="h200", dwdp_size=4,
                                    experts_per_worker=10, prefetch_stride=10, prefetch_slots=2)
    assert not ok and "coverage rule" in msg and bd is None
    ok, msg, _ = memory.memory_fit(model="deepseek-r1", dtype="nvfp4", hardware="h200", dwdp_size=4,
                                   experts_per_worker=64, prefetch_stride=64, prefetch_slots=1)
    assert not ok and "slots" in msg
    ok, msg, _ = memory.memory_fit(model="nope", dtype="nvfp4", hardware="h200", dwdp_size=4,
                                   experts_per_worker=64, prefetch_stride=64, prefetch_slots=2)
    assert not ok and "neither a preset" in msg


def test_memory_fit_follows_expert_replicas():
    """r = 2 keeps one predecessor's experts per rank: the replica part is about one more local share; an elastic
    group replays no CUDA graphs, so its graph pool is gone."""
    kw = dict(model="qwen3-235b-a22b", dtype="fp8", hardware="h200-hgx", dwdp_size=4, experts_per_worker=32,
              prefetch_stride=32, prefetch_slots=2)
    ok1, msg1, one = memory.memory_fit(**kw)
    ok2, msg2, two = memory.memory_fit(**kw, expert_replicas=2)
    assert ok1 and ok2 and one.replica_experts == 0 and "replicas" not in msg1
    assert two.replica_experts == pytest.approx(one.local_experts + one.local_expert_scales, rel=0.01)
    assert one.graph_pool > 0 and two.graph_pool == 0
    assert two.kv_cache_available == pytest.approx(one.kv_cache_available - two.replica_experts + one.graph_pool)
    assert "+ replicas" in msg2 and "(r=2)" in msg2
    ok, msg, bd = memory.memory_fit(**kw, expert_replicas=5)
    assert not ok and bd is None and "expert_replicas=5 must be in [1, dwdp_size=4]" in msg


def test_plan_reports_the_replica_memory():
    from dwdp_runtime.planner.plan import plan

    kw = dict(model="qwen3-235b-a22b", dtype="fp8", hardware="h200-hgx", dwdp_size=4, experts_per_worker=32,
              prefetch_stride=32, with_crossover=False, with_recommendation=False)
    one, two = plan(**kw), plan(**kw, expert_replicas=2)
    assert one.memory_gib["replica_experts"] == 0 and two.expert_replicas == 2
    assert two.memory_gib["replica_experts"] == pytest.approx(one.memory_gib["local_experts"]
                                                              + one.memory_gib["local_expert_scales"], abs=0.01)
    with pytest.raises(ValueError, match="expert_replicas=5 must be in"):
        plan(**kw, expert_replicas=5)


def test_graph_pool_is_the_largest_padded_shape_s_activations_and_follows_the_switch():
    """The graphs' shared pool holds one forward of the largest padded shape: max_num_tokens rounded up the ladder."""
    from dwdp_runtime.graph_buckets import largest_bucket_tokens

    kw = dict(model="qwen3-30b-a3b", dtype="bf16", hardware="h200-hgx", ranges=[(0, 64), (64, 128)],
              experts_per_worker=64, prefetch_slots=2, max_num_tokens=9000)
    on, off = memory.breakdown(**kw), memory.breakdown(**kw, cuda_graphs=False)
    shape = memory.load_model("qwen3-30b-a3b")
    assert largest_bucket_tokens(9000) == 9216
    assert on.graph_pool == pytest.approx(memory.activation_bytes(shape, tokens=9216))
    assert off.graph_pool == 0 and on.used - off.used == pytest.approx(on.graph_pool)


def test_w4a8_scratch_is_one_layer_of_e4m3_experts_and_follows_the_kernel_choice():
    """FP4 experts served W4A8 hold one MoE layer's experts re-encoded (1 byte per weight + fp32 per 128×128
    block) while it runs; weight-only and the other dtypes hold none."""
    kw = dict(model="qwen3-30b-a3b", hardware="h200-hgx", ranges=[(0, 64), (64, 128)], experts_per_worker=64,
              prefetch_slots=2, max_num_tokens=4096)
    w4a8, weight_only = memory.breakdown(**kw, dtype="nvfp4"), memory.breakdown(**kw, dtype="nvfp4",
                                                                                 fp4_kernel="weight-only")
    h, i, e = 2048, 768, 128
    expected = e * 2 * i * h + 4 * e * 2 * (i // 128) * (h // 128)   # gate_up, the larger projection, in one chunk
    assert w4a8.w4a8_scratch == expected and weight_only.w4a8_scratch == 0
    assert weight_only.kv_cache_available - w4a8.kv_cache_available == pytest.approx(expected)
    assert memory.breakdown(**kw, dtype="bf16").w4a8_scratch == 0 == memory.breakdown(**kw, dtype="fp8").w4a8_scratch
    assert memory.breakdown(**kw, dtype="mxfp4").w4a8_scratch == expected
    # gpt-oss-120b's 2880-wide projections are blocked with a ragged edge (23 × 23 blocks); its 128 experts'
    # gate_up (2.1 GB in e4m3) is re-encoded in chunks of 50 experts within the 1 GiB budget
    oss = memory.w4a8_scratch(memory.load_model("gpt-oss-120b"), dtype=DTYPES["mxfp4"])
    per_expert = 2 * (2880 * 2880 + 4 * 23 * 23)
    assert oss == (GIB // per_expert) * per_expert
    # DeepSeek-R1's 256 experts are 11.3 GB in e4m3 per layer: chunks of experts keep it under the budget
    r1 = memory.w4a8_scratch(memory.load_model("deepseek-r1"), dtype=DTYPES["nvfp4"])
    assert 0.9 * GIB < r1 <= GIB
    with pytest.raises(ValueError, match="fp4_kernel"):
        memory.breakdown(**kw, dtype="nvfp4", fp4_kernel="int4")
