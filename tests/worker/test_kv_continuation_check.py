"""The GPU test's continuation check (``kv_programs.logit_agreement``) on CPU, on the GPU test's own random bf16
model with short prompts: a continuation from the right cache passes it, one from a wrong cache fails it."""

from __future__ import annotations

import pytest
import torch

from .kv_programs import forced_logits, logit_agreement, teacher_forced, wrong_cache

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_worker.launch.oracle import Reference

    torch.set_num_threads(2)
    d = write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "kv", seed=5, dtype="bfloat16",
                        hidden_size=1024, num_layers=8, num_heads=16, num_experts=8, vocab_size=4096,
                        max_positions=8192)      # tests/gpu/test_kv_gpu.py's model
    return Reference(d).model


def test_a_right_cache_passes_and_a_wrong_one_fails(bf16_model):
    from dwdp_worker.kv.prefill import cache_from, cached_prefill, continue_greedy

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (64, 40)]
    logits, kv = cached_prefill(bf16_model, prompts, "cpu")             # packed, like the engine
    for i, prompt in enumerate(prompts):
        first = int(logits[i].argmax())
        tokens, got = continue_greedy(bf16_model, prompt, first, cache_from(bf16_model, kv[i]), NEW_TOKENS)
        forced = teacher_forced(bf16_model, prompt, tokens)              # the prompt alone, no cache
        right = logit_agreement(got, forced)
        assert right["ok"], right                                       # within bf16 noise (packed vs alone)
        bad = wrong_cache(kv[i], kv[1 - i])
        wrong = logit_agreement(forced_logits(bf16_model, tokens[:-1], cache=cache_from(bf16_model, bad),
                                              start=len(prompt)), forced)
        assert not wrong["ok"] and wrong["median_max_abs"] > 4 * max(right["median_max_abs"], 0.05), wrong
