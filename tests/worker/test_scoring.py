"""Prompt scoring math on the real unsharded transformers model: the all-positions logits of one packed
forward equal the last-position logits of every prefix run on its own, and ``prompt_scores`` reads the
actual next prompt token from them."""

from __future__ import annotations

import pytest
import torch

from dwdp_worker.launch.oracle import Reference
from dwdp_worker.model.packing import packed_scored_logits
from dwdp_worker.rank.scoring import next_tokens, prompt_scores


@pytest.fixture(scope="module")
def ref(model_dir):
    return Reference(model_dir)


def test_scored_logits_equal_each_prefix_alone_and_unflagged_rows_are_untouched(ref):
    prompt, other = [5, 17, 42, 99, 3], [7, 8]
    last, per_seq = packed_scored_logits(ref.model, [other, prompt, [9]], ref.device, [False, True, True])
    assert per_seq[0] is None and per_seq[1].shape == (len(prompt) - 1, last.shape[-1])
    assert per_seq[2].shape[0] == 0  # a one-token prompt has nothing to score
    plain = ref.logits([other, prompt, [9]])
    torch.testing.assert_close(last, plain, rtol=1e-4, atol=1e-4)
    for j in range(len(prompt) - 1):
        torch.testing.assert_close(per_seq[1][j], ref.logits([prompt[: j + 1]])[0], rtol=1e-4, atol=1e-4)


def test_prompt_scores_pick_the_actual_next_tokens(ref):
    prompt = [5, 17, 42, 99, 3]
    _, (logits,) = packed_scored_logits(ref.model, [prompt], ref.device, [True])
    s = prompt_scores(logits, prompt, top_n=3)
    logp = torch.log_softmax(logits, -1)
    assert s.logprobs == pytest.approx([float(logp[j, prompt[j + 1]]) for j in range(4)], abs=1e-6)
    assert all(len(t) == 3 and t[0][1] >= t[1][1] >= t[2][1] for t in s.top)
    ids, lps, tops = next_tokens(logits, 2)
    assert [t[0][0] for t in tops] == ids and [t[0][1] for t in tops] == pytest.approx(lps)
