"""The engine's cache path: packed prefill with the model's KV cache, optional KV handoff, greedy decode.

``generate_batch`` runs for one packed batch (under the engine's lock):
  * every sequence asks ``max_new_tokens ≥ 1`` greedy tokens and optionally ``keep_kv`` (a request id):
    its prompt's K/V go into the rank's registered KV region (``kv.service``) and the output carries the
    ``KvTransferParams`` a decode engine pulls with (or ``kv_error`` when the budget is full → 429);
  * batches that need neither a cache nor the KV run the no-cache packed forward (``packing``), exactly
    as before, so the context-only path pays nothing for this feature;
  * the first token of each sequence comes from the packed prefill, bitwise the no-cache logits
    (``kv.prefill``); the others from ``model.generate`` on that sequence's cache (batch 1).

Invariant: a sequence's first token and logits do not depend on whether it keeps its KV or decodes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..kv.prefill import cache_from, cached_prefill, continue_greedy
from ..kv.store import KvBudgetFull
from ..model.packing import BadBatchError, packed_logits


class KvDisabledError(BadBatchError):
    """A sequence asked to keep its KV on a rank started without a KV budget."""


@dataclass
class SequenceOutput:
    tokens: list[int]                 # greedy tokens, ``max_new_tokens`` of them
    logits: Any                       # [len(tokens), vocab] float32 CPU: the logits that chose each token
    kv_params: Any = None             # KvTransferParams when the KV was kept
    kv_error: str | None = None       # why it was not (budget full)


def check_requests(sequences, max_new_tokens, keep_kv, *, max_positions: int, kv_enabled: bool):
    n = len(sequences)
    max_new = list(max_new_tokens) if max_new_tokens is not None else [1] * n
    keep = list(keep_kv) if keep_kv is not None else [None] * n
    if len(max_new) != n or len(keep) != n:
        raise BadBatchError("max_new_tokens and keep_kv need one entry per sequence")
    for i, (seq, m) in enumerate(zip(sequences, max_new)):
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise BadBatchError(f"sequence {i}: max_new_tokens must be an integer >= 1")
        if len(seq) + m - 1 > max_positions:
            raise BadBatchError(f"sequence {i}: {len(seq)} tokens + {m - 1} more > max_position_embeddings="
                                f"{max_positions}")
    if any(k is not None for k in keep) and not kv_enabled:
        raise KvDisabledError("KV transfer is off on this server (start it with a KV budget: --kv-budget-bytes)")
    return max_new, keep


def generate_batch(model, device, sequences: Sequence[list[int]], max_new: Sequence[int],
                   keep: Sequence[str | None], kv_service=None, *, model_name: str = "",
                   decode_budget_s: float | None = None) -> list[SequenceOutput]:
    """``decode_budget_s``: stop decoding a sequence after this long (it gets fewer tokens; the caller asks
    again for the rest), so one call stays bounded however slow a forward is."""
    import torch

    if all(m == 1 for m in max_new) and all(k is None for k in keep):
        logits = packed_logits(model, sequences, device)
        return [SequenceOutput(tokens=[int(torch.argmax(logits[i]))], logits=logits[i:i + 1])
                for i in range(len(sequences))]
    logits, per_seq = cached_prefill(model, sequences, device)
    outs = []
    for i, seq in enumerate(sequences):
        first = int(torch.argmax(logits[i]))
        out = SequenceOutput(tokens=[first], logits=logits[i:i + 1])
        if keep[i] is not None:
            try:
                out.kv_params = kv_service.keep(keep[i], per_seq[i], len(seq), model=model_name)
            except KvBudgetFull as exc:
                out.kv_error = str(exc)
        if max_new[i] > 1:
            out.tokens, step_logits = continue_greedy(model, seq, first, cache_from(model, per_seq[i]), max_new[i],
                                                      max_time_s=decode_budget_s)
            out.logits = torch.cat([out.logits, step_logits])
        outs.append(out)
    return outs
