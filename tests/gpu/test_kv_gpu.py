"""KV handoff with the KV in GPU memory (H200): a 2-rank CUDA group prefills and keeps the KV in its
NIXL-registered GPU region; a separate process pulls it GPU-to-GPU with the reference client and decodes
with plain transformers. Prints pull GB/s and the prefill time added by keeping the cache.

Asserted: the pulled K/V bitwise (against the region and the unsharded model's own cache); the continuation
from the pulled cache bitwise the same decode from a cache computed in the decode process (same kernels);
and that continuation against ``generate``'s model by teacher forcing, within the bf16 tolerance of
``tests/worker/kv_programs.py`` (``TF_MEDIAN_ATOL``, ``TF_COS``), which a wrong cache fails — checked on
the spot. Token agreement with ``generate`` is printed, not asserted: generate prefills each prompt alone,
and bf16 GEMMs are not batch-invariant (docs/KERNELS.md).

    python -m pytest -m gpu tests/gpu/test_kv_gpu.py -s
"""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from ..worker.kv_programs import TF_COS

pytestmark = pytest.mark.gpu

#: 4 sequences of 2048 tokens: per sequence 8 layers × K+V × 8 heads × 2048 × 128 × 2 B = 64 MiB of KV
SEQ_LEN, NUM_SEQS, NEW_TOKENS = 2048, 4, 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "kv", seed=5, dtype="bfloat16",
                           hidden_size=1024, num_layers=8, num_heads=16, num_experts=8, vocab_size=4096,
                           max_positions=8192)


def test_kv_round_trip_in_gpu_memory(model_dir, tmp_path):
    pytest.importorskip("nixl_cu13", reason="needs NIXL (pip install nixl-cu13; carried as a wheel on the GPU box)")
    import torch

    from ..runtime.group import run_group
    from .kv_gpu_programs import gpu_decode_program, gpu_prefill_program

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (SEQ_LEN - 97 * i,), generator=g).tolist() for i in range(NUM_SEQS)]
    exchange = tmp_path / "x"
    exchange.mkdir()
    result = tmp_path / "decode.json"
    ctx = mp.get_context("spawn")
    decoder = ctx.Process(target=gpu_decode_program, kwargs=dict(model_dir=str(model_dir), prompts=prompts,
                                                                 exchange=str(exchange), new_tokens=NEW_TOKENS,
                                                                 result=str(result)))
    decoder.start()
    try:
        res = run_group(gpu_prefill_program, 2, model_dir=str(model_dir), prompts=prompts, exchange=str(exchange),
                        budget_bytes=2 << 30, repeats=5, harness_timeout_s=540)
    finally:
        decoder.join(timeout=120)
        if decoder.is_alive():
            decoder.kill()
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    assert decoder.exitcode == 0 and result.exists()
    rows = json.loads(result.read_text())["rows"]
    r0 = res[0][1]
    plain, kept = r0["prefill_plain_s"], r0["prefill_keep_kv_s"]
    print(f"\nKV handoff on {torch.cuda.get_device_name(0)}: {NUM_SEQS} × ~{SEQ_LEN} tokens packed")
    print(f"prefill (median of 5): no cache {plain * 1e3:.2f} ms, keeping the KV {kept * 1e3:.2f} ms "
          f"(+{(kept - plain) * 1e3:.2f} ms, {100 * (kept / plain - 1):.1f} %)")
    for i, row in enumerate(rows):
        agree = sum(a == b for a, b in zip(row["tokens"], row["expected"]))
        tf, wrong = row["teacher_forced"], row["wrong_cache"]
        print(f"seq {i}: {row['nbytes'] / 2**20:.1f} MiB on {row['device']}, claim {row['claim_s'] * 1e3:.2f} ms, "
              f"register {row['register_s'] * 1e3:.2f} ms, READ {row['read_s'] * 1e3:.2f} ms = {row['gbps']:.1f} GB/s, "
              f"verdict {row['verdict_s'] * 1e3:.2f} ms, bitwise={row['bitwise']}, "
              f"max|K-K_unsharded|={row['max_diff_vs_unsharded']:.3g}")
        print(f"  continuation: bitwise the local-cache decode={row['continuation_bitwise']}; teacher-forced "
              f"median max|Δ| {tf['median_max_abs']:.3f} (max {tf['max_abs']:.3f}), {100 * tf['agreeing']:.0f} % of "
              f"positions cos ≥ {TF_COS}; a wrong cache: median {wrong['median_max_abs']:.3f}, "
              f"{100 * wrong['agreeing']:.0f} %; tokens agree with generate {agree}/{NEW_TOKENS}")
        if not row["continuation_bitwise"]:
            ltf = row["local_teacher_forced"]
            print(f"  not bitwise: the pulled decode repeats itself bitwise={row['repeat_bitwise']}; the local decode "
                  f"follows the prompt {100 * ltf['agreeing']:.0f} % (max {ltf['max_abs']:.3f}); first token that "
                  f"differs: {row['first_token_diff']}; max|Δ logits| per step: "
                  + " ".join(f"{d:.3g}" for d in row["step_logit_diff"]))
    for row in rows:
        assert row["bitwise"] and row["device"].startswith("cuda")
        assert len(row["tokens"]) == NEW_TOKENS
        assert row["max_diff_vs_unsharded"] == 0                  # same kernels, unsharded: bitwise
        # the first decode step reads nothing but the cache: bitwise the same step from the local cache
        assert row["step_logit_diff"][0] == 0, row["step_logit_diff"]
        # the whole continuation bitwise — unless the decoder itself does not repeat on one fixed cache (seen
        # once on H200 in 8 sequences: then a bitwise comparison says nothing of the cache, and the first step
        # above plus the teacher-forced checks below carry the test)
        assert (row["continuation_bitwise"] and row["tokens"] == row["local_tokens"]) or not row["repeat_bitwise"], \
            (row["first_token_diff"], row["step_logit_diff"])
        assert row["teacher_forced"]["ok"], row["teacher_forced"]  # follows from the prompt, within bf16 noise
        assert not row["wrong_cache"]["ok"], row["wrong_cache"]    # … and the check can tell a wrong cache
    after = r0["kv_stats_after"]
    assert after["pulls_total"] == NUM_SEQS and after["held_sequences"] == 0
