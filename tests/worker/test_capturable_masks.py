"""attention (worker/dwdp_worker/model/attention.py): `transformers`' causal mask skipped exactly where it
skips it outside a capture, through the real mask registry and a real model."""

import torch
from transformers import masking_utils

from dwdp_worker.model import attention
from dwdp_worker.model.attention import causal_skip

CAUSAL = masking_utils.causal_mask_function
PLAIN = dict(batch_size=1, q_length=16, kv_length=16, q_offset=0, kv_offset=0, mask_function=CAUSAL,
             attention_mask=None, allow_is_causal_skip=True)


def test_only_a_plain_causal_forward_skips_its_mask():
    assert causal_skip(PLAIN, CAUSAL)
    assert not causal_skip({**PLAIN, "allow_is_causal_skip": False}, CAUSAL)  # packed sequences
    assert not causal_skip({**PLAIN, "attention_mask": torch.ones(1, 16, dtype=torch.bool)}, CAUSAL)
    assert not causal_skip({**PLAIN, "local_size": 4}, CAUSAL)  # sliding window
    assert not causal_skip({**PLAIN, "kv_length": 32, "q_offset": 16}, CAUSAL)  # a cache before the queries
    assert not causal_skip({**PLAIN, "mask_function": masking_utils.and_masks(CAUSAL, CAUSAL)}, CAUSAL)


def test_outside_a_capture_one_sequence_changes_no_bit_and_is_undone(tmp_path):
    from dwdp_worker.model.packing import device_logits, pack
    from dwdp_worker.checkpoint.synth import write_synthetic
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(write_synthetic("qwen3_moe", tmp_path / "m", seed=3),
                                                 attn_implementation="sdpa").eval()
    one = pack([list(range(3, 40))])
    before = device_logits(model, *one)
    registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    original, find_packed = registry["sdpa"], masking_utils.find_packed_sequence_indices
    with attention.one_sequence():
        wrapper = registry["sdpa"]
        assert wrapper is not original and wrapper(**PLAIN) is None
        assert wrapper(**{**PLAIN, "allow_is_causal_skip": False}).shape == (1, 1, 16, 16)  # deferred
        assert torch.equal(device_logits(model, *one), before)  # the same bits as transformers alone
    assert registry["sdpa"] is original and masking_utils.find_packed_sequence_indices is find_packed


def test_inside_a_simulated_capture_one_sequence_keeps_the_causal_kernel(monkeypatch):
    # a capture as `transformers` 5.17 sees one: ``is_tracing`` true (real captures need a GPU: the GPU test
    # tests/gpu/test_prefill_graphs_gpu.py checks the replayed logits bitwise against the eager ones)
    from transformers import AutoConfig

    monkeypatch.setattr(masking_utils, "is_tracing", lambda tensor=None: True)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                                  num_hidden_layers=1, vocab_size=64)
    config._attn_implementation = "sdpa"
    embeds, positions = torch.zeros(1, 12, 32), torch.arange(12).unsqueeze(0)

    def mask():
        # positionally: the cache argument is ``past_key_values`` in 5.17, ``cache`` in later releases
        return masking_utils.create_causal_mask(config, embeds, None, None, position_ids=positions)

    assert mask() is not None  # traced, transformers cannot rule out packing: a dense mask
    with attention.one_sequence():
        assert mask() is None  # one sequence, known: the causal kernel, as in the eager forward
    assert mask() is not None  # undone
