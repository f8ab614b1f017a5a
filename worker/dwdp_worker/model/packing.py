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

from array import array
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
        # the ids' distinct types, collected in C (a per-id Python test cost ~0.5 ms per 8K-token prompt, on the
        # host path of every request): ints, not bool (an int subclass, but no token id)
        if not all(issubclass(kind, int) and not issubclass(kind, bool) for kind in set(map(type, seq))):
            raise BadBatchError(f"sequence {i}: token ids must be integers")
        lo, hi = min(seq), max(seq)
        if lo < 0 or hi >= vocab_size:
            raise BadBatchError(f"sequence {i}: token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})")
        if len(seq) > max_positions:
            raise BadBatchError(f"sequence {i}: {len(seq)} tokens > the model's max_position_embeddings={max_positions}")
        out.append(list(seq))
    return out


#: the id of the tokens ``pack`` pads with (``rank.graph_buckets``): every vocabulary has it, and the padded
#: positions' logits are never read
PAD_TOKEN_ID = 0


def pack(sequences: Sequence[Sequence[int]], device="cpu", *, tokens: int | None = None, rows: int | None = None):
    """``(input_ids [1, T], position_ids [1, T], last [n])`` int64 on ``device`` (module docstring). The ids and
    positions are gathered into int64 arrays in C and viewed as tensors (``torch.tensor`` of a Python list cost
    ~0.75 ms per 8K-token prompt, on the critical host path of every forward).

    Padded to a CUDA graph's shape (``rank.graph_buckets``): ``tokens`` ≥ T makes the row that long, the extra
    tokens (``PAD_TOKEN_ID``) continuing the **last** sequence, positions going on — the sequences the positions
    announce are unchanged and no real token attends to a padded one; ``rows`` ≥ n repeats ``last``'s final
    index (those logits rows are the caller's to drop)."""
    import torch

    ids, lengths = array("q"), []
    for seq in sequences:
        ids.extend(seq)
        lengths.append(len(seq))
    if not ids:
        raise BadBatchError("a batch must hold at least one token")
    real = len(ids)
    if tokens is not None:
        if tokens < real:
            raise ValueError(f"cannot pad {real} tokens to {tokens}")
        ids.extend([PAD_TOKEN_ID] * (tokens - real))
        lengths[-1] += tokens - real
    lens = torch.tensor(lengths, dtype=torch.long)
    ends = torch.cumsum(lens, 0)
    # position j of a sequence starting at s is (s + j) - s: one arange less each token's sequence start
    positions = torch.arange(len(ids), dtype=torch.long) - torch.repeat_interleave(ends - lens, lens)
    input_ids = torch.frombuffer(ids, dtype=torch.long).clone()  # off the array's buffer, which is not kept
    last = ends - 1
    last[-1] -= len(ids) - real  # the last sequence's own last token, not the padding's
    if rows is not None:
        if rows < len(lengths):
            raise ValueError(f"cannot pad {len(lengths)} sequences to {rows}")
        last = torch.cat([last, last[-1:].expand(rows - len(lengths))])
    return (input_ids.to(device).unsqueeze(0), positions.to(device).unsqueeze(0), last.to(device))


def device_logits(model, input_ids, position_ids, last):
    """Last-position logits ``[n, vocab]`` on the model's device, of one packed forward (``pack``'s tensors), no
    KV cache, nothing synchronised: what ``packed_logits`` runs eagerly and ``prefill_graphs`` captures.

    A single sequence is run without ``position_ids`` (its positions are 0.., which `transformers` builds itself
    from the cache positions, bit for bit the same): the packing the positions would announce is then none.
    (`transformers` still tests the positions it builds for packing; inside a CUDA-graph capture, where that
    host test cannot run, ``attention.one_sequence`` answers it.)"""
    import torch

    with torch.inference_mode():
        out = model(input_ids=input_ids, position_ids=position_ids if last.numel() > 1 else None,
                    use_cache=False, logits_to_keep=last)
    return out.logits[0]


def packed_logits(model, sequences: Sequence[Sequence[int]], device):
    """Last-position logits ``[len(sequences), vocab]`` (float32, CPU) of one packed forward, no KV cache."""
    return device_logits(model, *pack(sequences, device)).float().cpu()


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
