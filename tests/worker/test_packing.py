"""``packing.pack`` and ``packing.validate``, the host path of every forward: pack's rows against their definition
(ids concatenated, positions restarting at 0 per sequence, each sequence's last index) for any batch shape, and
validate's refusals (bool, float, None, str ids; empty batches and sequences; out-of-vocabulary, too long)."""

from __future__ import annotations

import enum

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp_worker.model.packing import BadBatchError, pack, validate


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**40), min_size=1, max_size=40), min_size=1, max_size=12))
def test_pack_rows_are_their_definition(batch):
    ids, pos, last = pack(batch)
    want_ids = [t for seq in batch for t in seq]
    want_pos = [j for seq in batch for j in range(len(seq))]
    ends = [sum(len(s) for s in batch[:i + 1]) - 1 for i in range(len(batch))]
    assert ids.dtype == pos.dtype == last.dtype == torch.long
    assert ids.tolist() == [want_ids] and pos.tolist() == [want_pos] and last.tolist() == ends


def test_pack_refuses_a_batch_without_tokens():
    with pytest.raises(BadBatchError, match="at least one token"):
        pack([[]])


class Token(enum.IntEnum):
    SEVEN = 7


@pytest.mark.parametrize("bad, message", [
    ([[1, True]], "must be integers"), ([[1, 2.0]], "must be integers"), ([[None]], "must be integers"),
    ([["3"]], "must be integers"), ([[]], "non-empty list"), ([], "non-empty list"), ("12", "non-empty list"),
    ([[3, 10]], "outside the vocabulary"), ([[-1]], "outside the vocabulary"), ([[1] * 9], "max_position_embeddings"),
])
def test_validate_refuses_what_cannot_run(bad, message):
    with pytest.raises(BadBatchError, match=message):
        validate(bad, vocab_size=10, max_positions=8)


def test_validate_keeps_int_ids_and_their_subclasses():
    assert validate([(1, 2), [Token.SEVEN]], vocab_size=10, max_positions=8) == [[1, 2], [7]]
