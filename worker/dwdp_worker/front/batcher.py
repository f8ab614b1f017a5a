"""Pure request packing: no asyncio, no processes, no torch (admission rules: ``admission``).

A *step* is one forward of one request: the request's current token list (prompt plus the greedy
tokens generated so far). The front keeps pending steps in one FIFO (``collections.deque``);
``pack`` takes a batch for one rank from its head.

Invariants (property-tested in ``tests/worker/test_batcher.py``):
  1. A batch is a prefix of the queue: no step overtakes an older one (no starvation), and the
     steps left behind keep their order.
  2. A non-empty queue always yields a non-empty batch: ``admission.admit`` refused every request whose
     longest step exceeds ``max_num_tokens``, so the head always fits alone.
  3. The tokens of a batch sum to at most ``max_num_tokens`` and it holds at most
     ``max_num_seqs`` steps.
  4. Every step leaves the queue exactly once per ``pack`` that takes it.
A request with ``max_tokens > 1`` is re-queued at the *head* after each forward (see
``requeue_front``) so a started request finishes before newer ones start (bounded latency).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable


def pack(queue: deque, *, max_num_tokens: int, max_num_seqs: int,
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
