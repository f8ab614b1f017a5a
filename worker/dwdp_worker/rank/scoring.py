"""Log-probabilities from logits, on the rank (float32 ``log_softmax``; only a few numbers per
position cross the pipe to the front).

``next_tokens`` is the greedy step of every sequence (argmax, its log-probability, top-N);
``prompt_scores`` is prompt scoring: the log-probability of each actual prompt token given the ones
before it (and the top-N at each position), for ``echo`` + ``logprobs`` requests.

Invariants: the chosen token's log-probability comes from the same ``log_softmax`` row as the top-N,
so a token that is its position's argmax has ``logprob == top[0][1]`` exactly; top-N is sorted by
log-probability, highest first; N is capped by the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptScores:
    logprobs: list[float]                  # log P(prompt[j + 1] | prompt[: j + 1]) for j = 0 .. len - 2
    top: list[list[tuple[int, float]]]     # top-N (id, logprob) at each of those positions


def _top_n(logp, top_n: int) -> list[list[tuple[int, float]]]:
    import torch

    if top_n <= 0:
        return [[] for _ in range(logp.shape[0])]
    vals, ids = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1)
    return [list(zip(i.tolist(), v.tolist())) for i, v in zip(ids, vals)]


def next_tokens(logits, top_n: int) -> tuple[list[int], list[float], list[list[tuple[int, float]]]]:
    """Greedy id, its log-probability and the top-N per row of ``logits [n, vocab]``."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    nxt = torch.argmax(logits, dim=-1)
    chosen = logp.gather(1, nxt[:, None])[:, 0]
    return nxt.tolist(), chosen.tolist(), _top_n(logp, top_n)


def prompt_scores(logits, tokens: list[int], top_n: int) -> PromptScores:
    """``logits [len(tokens) - 1, vocab]``: row j predicts ``tokens[j + 1]``."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(tokens[1:], dtype=torch.long)
    chosen = logp.gather(1, targets[:, None])[:, 0] if len(targets) else torch.empty(0)
    return PromptScores(logprobs=chosen.tolist(), top=_top_n(logp, top_n))
