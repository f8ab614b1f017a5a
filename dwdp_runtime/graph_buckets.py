"""The shapes prefill graphs are captured for: a packed batch rounded up to a bounded ladder (pure).

A CUDA graph replays fixed shapes, and a context server's packed batches come in every length, so a graph per
exact shape would almost never be replayed. A batch of ``T`` tokens in ``n`` sequences is therefore run at the
``Bucket`` ``(token_bucket(T), sequence_bucket(n))``:

  * **tokens**: ``T`` rounded up to a multiple of the bucket's step, the step being ``1/STEPS_PER_OCTAVE`` of the
    power of two at or below ``T`` (never below ``MIN_TOKEN_STEP``): 8 buckets per doubling, so padding costs at
    most 12.5 % of a forward's tokens above 1K (at most ``MIN_TOKEN_STEP - 1`` tokens below), and 1K–32K tokens
    map to at most 49 shapes;
  * **sequences**: 1 stays 1 (a one-sequence graph keeps SDPA's causal kernel, ``model.attention``), more round
    up to a power of two (only the logits' row count depends on it).

How a batch is padded (``packing.pack(pad=...)``): the padding tokens continue the **last** sequence (token id
``packing.PAD_TOKEN_ID``, positions going on from its length), so the positions announce the same sequences and every
real token attends to exactly what it did unpadded (causal: nothing attends forward); their logits are never
read. The extra rows of ``last`` repeat its final index and are sliced off. A batch whose last sequence would
run past the model's ``max_positions`` has no bucket (it runs eagerly, unpadded).

Invariant: ``bucket_for`` never returns a bucket smaller than the batch, and the same batch always gets the same
bucket (so warm-up, capture and replay of a bucket see one shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

#: buckets per doubling of the token count: padding ≤ 1/8 of the tokens (≤ 12.5 % more prefill work)
STEPS_PER_OCTAVE = 8
#: the smallest token step: below 1K tokens a forward is launch-bound, so a few more rows cost ~nothing, and a
#: multiple of 128 keeps every padded row count on the kernels' 128-row tiles
MIN_TOKEN_STEP = 128


@dataclass(frozen=True)
class Bucket:
    """A packed batch's graph shape: tokens and sequences after padding."""

    tokens: int
    sequences: int


def token_bucket(tokens: int) -> int:
    """``tokens`` rounded up to its ladder step (module docstring); ``tokens`` ≥ 1."""
    if tokens < 1:
        raise ValueError(f"a batch has at least one token, got {tokens}")
    step = max(MIN_TOKEN_STEP, (1 << (tokens.bit_length() - 1)) // STEPS_PER_OCTAVE)
    return -(-tokens // step) * step


def sequence_bucket(sequences: int) -> int:
    """1 for one sequence, else the power of two at or above ``sequences``."""
    if sequences < 1:
        raise ValueError(f"a batch has at least one sequence, got {sequences}")
    return 1 if sequences == 1 else 1 << (sequences - 1).bit_length()


def bucket_for(lengths: Sequence[int], max_positions: int | None = None) -> Bucket | None:
    """The bucket of a batch of sequences of ``lengths``, or ``None`` when padding its last sequence would pass
    ``max_positions`` (the model's position limit; ``None``: no limit)."""
    total = sum(lengths)
    bucket = Bucket(token_bucket(total), sequence_bucket(len(lengths)))
    if max_positions is not None and lengths[-1] + (bucket.tokens - total) > max_positions:
        return None
    return bucket


def largest_bucket_tokens(max_num_tokens: int) -> int:
    """The most tokens a graph of a front packing at most ``max_num_tokens`` holds (what its memory is sized by)."""
    return token_bucket(max_num_tokens)
