"""Pure request packing and admission: no asyncio, no processes, no torch.

A *step* is one forward of one request: the request's current token list (prompt plus the greedy
tokens generated so far). The front keeps pending steps in one FIFO (``collections.deque``);
``pack`` takes a batch for one rank from its head.

Invariants (property-tested in ``tests/worker/test_batcher.py``):
  1. A batch is a prefix of the queue: no step overtakes an older one (no starvation), and the
     steps left behind keep their order.
  2. A non-empty queue always yields a non-empty batch: ``admit`` refused every request whose
     longest step exceeds ``max_num_tokens``, so the head always fits alone.
  3. The tokens of a batch sum to at most ``max_num_tokens`` and it holds at most
     ``max_num_seqs`` steps.
  4. Every step leaves the queue exactly once per ``pack`` that takes it.
A request with ``max_tokens > 1`` is re-queued at the *head* after each forward (see
``requeue_front``) so a started request finishes before newer ones start (bounded latency).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable


@dataclass(frozen=True)
class Limits:
    max_num_tokens: int
    vocab_size: int
    max_positions: int
    max_num_seqs: int = 256


def admit(tokens: list[int], max_tokens: int, limits: Limits) -> str | None:
    """Why the request cannot be served (a message for a 400), or ``None`` when it can.

    The longest step is the prompt plus ``max_tokens - 1`` generated tokens (the last generated
    token is never fed back).
    """
    if not tokens:
        return "prompt is empty: send at least one token (or non-empty text)"
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        shown = ", ".join(str(t) for t in bad[:5]) + (", …" if len(bad) > 5 else "")
        return (f"token ids out of range [0, {limits.vocab_size}) (the model's vocabulary): {shown}")
    longest = len(tokens) + max_tokens - 1
    if longest > limits.max_positions:
        return (f"prompt of {len(tokens)} tokens + max_tokens={max_tokens} needs {longest} positions; "
                f"the model supports {limits.max_positions}: shorten the prompt or lower max_tokens")
    if longest > limits.max_num_tokens:
        return (f"prompt of {len(tokens)} tokens + max_tokens={max_tokens} needs {longest} tokens in one "
                f"forward; this server packs at most --max-num-tokens={limits.max_num_tokens}: shorten the "
                f"prompt or lower max_tokens")
    return None


def pack(queue: deque, *, max_num_tokens: int, max_num_seqs: int = 256,
         length: Callable[[Any], int] = len) -> list:
    """Pop and return the longest prefix of ``queue`` that fits (invariants 1–4 above)."""
    batch: list = []
    total = 0
    while queue and len(batch) < max_num_seqs:
        n = length(queue[0])
        if batch and total + n > max_num_tokens:
            break
        batch.append(queue.popleft())
        total += n
    return batch


def requeue_front(queue: deque, steps: Iterable) -> None:
    """Put continuing steps back at the head, keeping their relative order."""
    for step in reversed(list(steps)):
        queue.appendleft(step)


def queued_tokens(queue: Iterable, length: Callable[[Any], int] = len) -> int:
    return sum(length(s) for s in queue)
