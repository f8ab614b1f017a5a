"""Pure packing and admission rules (``dwdp_worker.front.batcher``, ``dwdp_worker.front.admission``), property-tested."""

from __future__ import annotations

from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from .serving_helpers import ROOT  # noqa: F401 - puts this checkout on sys.path

from dwdp_worker.front.admission import Limits, Param, admit, text_fits
from dwdp_worker.front.batcher import pack, queued_tokens, requeue_front

LIMITS = Limits(max_num_tokens=32, vocab_size=100, max_positions=24)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 32), max_size=40), max_seqs=st.integers(1, 8))
def test_pack_takes_the_longest_fitting_prefix(lengths, max_seqs):
    queue = deque([[0] * n for n in lengths])
    ids = [id(x) for x in queue]
    drained = []
    while queue:
        before = len(queue)
        batch = pack(queue, max_num_tokens=32, max_num_seqs=max_seqs)
        assert batch, "a non-empty queue must give a non-empty batch"
        assert len(batch) <= max_seqs
        assert sum(map(len, batch)) <= 32 or len(batch) == 1
        # maximal: the next step would not have fitted (or the sequence cap was hit)
        if queue and len(batch) < max_seqs:
            assert sum(map(len, batch)) + len(queue[0]) > 32
        assert len(queue) == before - len(batch)
        drained += batch
    assert [id(x) for x in drained] == ids  # FIFO, each step exactly once


def test_pack_empty_queue_and_custom_length():
    assert pack(deque(), max_num_tokens=8, max_num_seqs=4) == []
    q = deque(["aaaa", "bbbb", "cc"])
    assert pack(q, max_num_tokens=9, max_num_seqs=4, length=len) == ["aaaa", "bbbb"]
    assert list(q) == ["cc"]


def test_requeue_front_keeps_order_before_newer_steps():
    q = deque(["new1", "new2"])
    requeue_front(q, ["old1", "old2", "old3"])
    assert list(q) == ["old1", "old2", "old3", "new1", "new2"]
    assert queued_tokens(q) == sum(map(len, q))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(-5, 120), max_size=30), max_tokens=st.integers(1, 30))
def test_admit_accepts_exactly_what_a_forward_can_take(tokens, max_tokens):
    why = admit(tokens, max_tokens, LIMITS)
    fits = (bool(tokens) and all(0 <= t < 100 for t in tokens)
            and len(tokens) + max_tokens - 1 <= min(LIMITS.max_positions, LIMITS.max_num_tokens))
    assert (why is None) == fits, (tokens, max_tokens, why)
    if why is not None:
        assert len(why.message) > 20 and why.param is Param.PROMPT  # a sentence naming the field, not a code


def test_admit_messages_say_what_to_change():
    assert "empty" in admit([], 1, LIMITS).message
    assert "[0, 100)" in admit([3, 100], 1, LIMITS).message and "100" in admit([3, 100], 1, LIMITS).message
    long = admit([1] * 20, 6, LIMITS)
    assert "positions" in long.message and "max_tokens" in long.message and long.param is Param.PROMPT
    packing = Limits(max_num_tokens=10, vocab_size=100, max_positions=24)
    assert "--max-num-tokens=10" in admit([1] * 8, 4, packing).message
    assert admit([1] * 8, 3, packing) is None


def test_text_fits_names_the_field_to_change():
    packing = Limits(max_num_tokens=10, vocab_size=100, max_positions=24)
    assert text_fits("x" * 10, 11, packing, 4).param is Param.MAX_TOKENS   # no room for any prompt
    assert text_fits("x" * 41, 1, packing, 4).param is Param.PROMPT        # 10 tokens × 4 characters < 41
    assert text_fits("x" * 40, 1, packing, 4) is None
