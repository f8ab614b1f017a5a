"""CUDA graphs by default (issue #34): the padded shape ladder (dwdp_runtime/graph_buckets.py), the padding
``packing.pack`` applies, the logits a padded batch gives on a real `transformers` model, and which ranks get
graphs when ``--cuda-graphs`` is unset (prefill_graphs.rank_cuda_graphs)."""

from __future__ import annotations

import pytest
import torch

from dwdp_runtime.contract import DEFAULT_CUDA_GRAPHS
from dwdp_runtime.graph_buckets import (MIN_TOKEN_STEP, STEPS_PER_OCTAVE, Bucket, bucket_for, largest_bucket_tokens,
                                        sequence_bucket, token_bucket)
from dwdp_worker.model.packing import PAD_TOKEN_ID, device_logits, pack
from dwdp_worker.rank.prefill_graphs import rank_cuda_graphs


@pytest.mark.parametrize("tokens", [1, 127, 128, 129, 1000, 1024, 1025, 4095, 4097, 8191, 16384, 16385, 100_000])
def test_a_bucket_holds_the_batch_and_pads_at_most_an_eighth_above_1k(tokens):
    b = token_bucket(tokens)
    assert b >= tokens and b % MIN_TOKEN_STEP == 0
    assert b - tokens < max(MIN_TOKEN_STEP, tokens / STEPS_PER_OCTAVE)
    assert token_bucket(b) == b  # a bucket is its own bucket: warm-up, capture and replay see one shape


def test_the_ladder_is_bounded_and_powers_of_two_are_exact():
    assert len({token_bucket(t) for t in range(1024, 16385)}) == 33
    assert len({token_bucket(t) for t in range(1, 1025)}) == 1024 // MIN_TOKEN_STEP
    assert all(token_bucket(1 << k) == 1 << k for k in range(7, 20))
    assert [sequence_bucket(n) for n in (1, 2, 3, 4, 5, 9, 256)] == [1, 2, 4, 4, 8, 16, 256]
    assert largest_bucket_tokens(8192) == 8192 and largest_bucket_tokens(9000) == 9216
    for bad in (0, -1):
        with pytest.raises(ValueError):
            token_bucket(bad)
        with pytest.raises(ValueError):
            sequence_bucket(bad)


def test_a_batch_past_the_model_positions_has_no_bucket():
    assert bucket_for([1000, 30]) == Bucket(1152, 2)
    assert bucket_for([1000, 30], max_positions=152) == Bucket(1152, 2)  # the last sequence ends at exactly 152
    assert bucket_for([1000, 30], max_positions=151) is None
    assert bucket_for([1030], max_positions=1100) is None


def test_padding_continues_the_last_sequence_and_repeats_its_last_index():
    seqs = [[5, 6, 7], [8, 9]]
    ids, pos, last = pack(seqs, tokens=8, rows=4)
    assert ids.tolist() == [[5, 6, 7, 8, 9] + [PAD_TOKEN_ID] * 3]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]  # still two sequences: no new restart
    assert last.tolist() == [2, 4, 4, 4]
    plain = pack(seqs)
    assert [t.tolist() for t in pack(seqs, tokens=5, rows=2)] == [t.tolist() for t in plain]
    with pytest.raises(ValueError, match="cannot pad 5 tokens to 4"):
        pack(seqs, tokens=4)
    with pytest.raises(ValueError, match="cannot pad 2 sequences to 1"):
        pack(seqs, rows=1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_padded_batch_gives_each_sequence_its_unpadded_logits(tmp_path, arch):
    """On a real `transformers` model (float32, CPU): the padding is attended by no real token, so every real
    sequence's last logits equal the unpadded forward's (to float32 rounding: another row count)."""
    from transformers import AutoModelForCausalLM

    from dwdp_worker.checkpoint.synth import write_synthetic

    path = write_synthetic(arch, tmp_path / arch, seed=3, hidden_size=64, num_layers=2, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for seqs in ([[t % 97 + 1 for t in range(40)]], [[3, 9, 27], [t % 50 + 2 for t in range(33)], [11, 12]]):
        b = bucket_for([len(s) for s in seqs], model.config.max_position_embeddings)
        padded = device_logits(model, *pack(seqs, tokens=b.tokens, rows=b.sequences))
        plain = device_logits(model, *pack(seqs))
        assert padded.shape[0] == b.sequences and b.tokens > sum(map(len, seqs))
        torch.testing.assert_close(padded[:len(seqs)], plain, rtol=1e-5, atol=1e-5)
        assert (padded[len(seqs):] == padded[len(seqs) - 1]).all()  # the repeated rows are the last sequence's


def test_unset_graphs_are_on_only_where_a_rank_can_replay_them():
    assert rank_cuda_graphs(None, gpu=True, elastic=False, batch_invariant=False) == DEFAULT_CUDA_GRAPHS
    for off in (dict(gpu=False, elastic=False, batch_invariant=False), dict(gpu=True, elastic=True, batch_invariant=False),
                dict(gpu=True, elastic=False, batch_invariant=True)):
        assert rank_cuda_graphs(None, **off) == 0, off
    assert rank_cuda_graphs(0, gpu=True, elastic=False, batch_invariant=False) == 0
    assert rank_cuda_graphs(5, gpu=True, elastic=False, batch_invariant=False) == 5


def test_the_launcher_leaves_cpu_and_elastic_ranks_eager_and_refuses_an_explicit_count_there(tmp_path):
    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_worker.launch.local import build_local_specs

    path = str(write_synthetic("qwen3_moe", tmp_path / "m", seed=0, hidden_size=64, num_layers=2, num_experts=8))
    kw = dict(model_dir=path, groups=1, dwdp_size=2, experts_per_worker=None, prefetch_stride=None, backend="host")
    assert {s.cuda_graphs for s in build_local_specs(**kw)} == {0}
    assert {s.cuda_graphs for s in build_local_specs(**kw, expert_replicas=2)} == {0}
    with pytest.raises(ValueError, match="CUDA graphs need the ranks on GPUs"):
        build_local_specs(**kw, cuda_graphs=2)
