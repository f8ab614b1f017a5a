"""Packed batches: several sequences in one row, attention kept inside each sequence.

``pack(sequences)`` → ``input_ids [1, T]``, ``position_ids [1, T]`` (restarting at 0 for every sequence)
and the index of each sequence's last token. With ``attention_mask=None`` `transformers` detects the
position restarts and builds a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``),
so every sequence attends only to itself. The engine and the oracle both run ``packed_logits`` so their
kernels see identical shapes — a precondition of a bitwise comparison.

Prompt scoring (``score``): for the sequences flagged, the logits of *every* position are kept, not only
the last; position ``j`` predicts token ``j + 1`` of the prompt. Memory: one ``[positions, vocab]``
block per scored sequence (bounded by ``--max-num-tokens`` × vocab), so scoring is opt-in per sequence.
"""

from __future__ import annotations

from typing import Any, Sequence


class BadBatchError(ValueError):
    """The sequences cannot be run (empty, non-integer, out-of-vocabulary or too long)."""


def validate(sequences: Any, *, vocab_size: int, max_positions: int) -> list[list[int]]:
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise BadBatchError("a batch must be a non-empty list of token-id lists")
    out = []
    for i, seq in enumerate(sequences):
        if not isinstance(seq, (list, tuple)) or not seq:
            raise BadBatchError(f"sequence {i}: must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in seq):
            raise BadBatchError(f"sequence {i}: token ids must be integers")
        lo, hi = min(seq), max(seq)
        if lo < 0 or hi >= vocab_size:
            raise BadBatchError(f"sequence {i}: token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})")
        if len(seq) > max_positions:
            raise BadBatchError(f"sequence {i}: {len(seq)} tokens > the model's max_position_embeddings={max_positions}")
        out.append(list(seq))
    return out


def pack(sequences: Sequence[Sequence[int]], device="cpu"):
    import torch

    ids, pos, last = [], [], []
    for seq in sequences:
        ids.extend(seq)
        pos.extend(range(len(seq)))
        last.append(len(ids) - 1)
    as_long = dict(dtype=torch.long, device=device)
    return torch.tensor([ids], **as_long), torch.tensor([pos], **as_long), torch.tensor(last, **as_long)


def packed_logits(model, sequences: Sequence[Sequence[int]], device) :
    """Last-position logits ``[len(sequences), vocab]`` (float32, CPU) of one packed forward, no KV cache."""
    import torch

    input_ids, position_ids, last = pack(sequences, device)
    with torch.inference_mode():
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=last)
    return out.logits[0].float().cpu()


def packed_scored_logits(model, sequences: Sequence[Sequence[int]], device, score: Sequence[bool]):
    """``(last_logits [n, vocab], prompt_logits)`` of one packed forward: ``prompt_logits[i]`` is
    ``[len(seq) - 1, vocab]`` (the positions predicting tokens 1.. of sequence i) when ``score[i]``,
    else ``None``. float32, CPU."""
    import torch

    input_ids, position_ids, last = pack(sequences, device)
    keep, spans, start = [], [], 0
    for flagged, end in zip(score, last.tolist()):
        first = len(keep)
        keep.extend(range(start, end + 1) if flagged else [end])
        spans.append((first, len(keep), flagged))
        start = end + 1
    with torch.inference_mode():
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                    logits_to_keep=torch.tensor(keep, dtype=torch.long, device=input_ids.device))
    kept = out.logits[0].float().cpu()
    last_rows = torch.stack([kept[b - 1] for _, b, _ in spans])
    return last_rows, [kept[a:b - 1] if flagged else None for a, b, flagged in spans]
