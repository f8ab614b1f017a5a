"""Packed prefill forwards replayed from CUDA graphs, one graph per batch shape.

Why: on an H200 a 8K-token FP8 prefill of the bench model is ~7.4 ms of kernels but 12–16 ms of wall time
(docs/MODELS.md, 2026-12-02): the host — `transformers`' modules in Python, DWDP's hooks, hundreds of kernel
launches — is what the GPU waits for, and the sharded forward's extra host work (hooks, copy calls) moved
its ratio to the unsharded one with the host's speed. A replay launches the whole forward, DWDP copies
included, in one call.

A graph's shapes are fixed, so a batch runs padded to its ``graph_buckets.Bucket`` (tokens rounded up on a
ladder of 8 steps per doubling, sequences to a power of two; the padding continues the last sequence, so no
real token sees it) and graphs are kept per bucket; which way a bucket's forward runs is ``BucketPolicy`` (pure):
  * a bucket's first forward runs eagerly — Triton's and CuTe's compilation and autotuning, cuBLAS handles and
    allocator growth all happen there, none of which may happen inside a capture;
  * its second is captured, then replayed (its own output), and every later one is replayed;
  * at most ``max_graphs`` buckets are captured; a batch whose bucket will never be captured (the budget is
    spent, its capture failed, or padding would pass the model's positions) runs eagerly **unpadded**;
  * the graphs share one memory pool (they never run at once: ``Engine.forward`` holds a lock), so their
    activations cost what the largest bucket's forward needs, once (``planner.memory``'s ``graph_pool``);
  * a capture that fails is logged once, its bucket stays eager, and the request still runs eagerly; after
    ``MAX_FAILED_CAPTURES`` failures the rank captures nothing more (a model that cannot be captured — e.g. one
    whose experts fall back to `transformers`' ``grouped_mm``, which copies from the host — would otherwise pay a
    failed capture for every new shape).

With a DWDP manager the capture wraps ``DwdpManager.capture`` and every replay follows ``join_copies``
(dwdp_runtime/weight_manager.py states why that keeps the prefetch ordering); a replay or capture needs the
prefetch schedule at a forward boundary, else the forward runs eagerly (and the schedule restarts as usual).
After a failed capture the schedule is invalidated: the host schedule advanced through a forward that never
ran, so its copies are re-issued.

Invariants: a replay's logits are bitwise those of the eager forward of the same padded batch (same kernels,
same shapes — ``attention`` keeps `transformers` on the causal attention kernel inside a capture; the GPU test
checks it); against the unpadded eager forward they differ only where a dense kernel picks another tiling for
another row count (cuBLAS; ``--batch-invariant`` is the mode that promises bits across shapes). Replays read
their inputs from the graph's static tensors, copied in on the device; the output is copied to the host
(float32) before the next replay can overwrite it. Scoring and KV-cache forwards are
not captured (``Engine.forward`` routes only plain prefill here).
"""

from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..model import attention
from ..model.packing import device_logits, pack
from dwdp_runtime.contract import DEFAULT_CUDA_GRAPHS
from dwdp_runtime.graph_buckets import Bucket, bucket_for

log = logging.getLogger(__name__)

#: eager forwards of a bucket before it is captured: one compiles and autotunes every kernel of the shape
WARMUP_FORWARDS = 1
#: failed captures after which a rank stops trying: a failure is a forward's worth of work and a schedule restart,
#: and a second one says the model, not one shape, cannot be captured
MAX_FAILED_CAPTURES = 2


def check_max_graphs(max_graphs: int, name: str = "max_graphs") -> None:
    """The one refusal of a graph count below 0 (``name``: how the caller's user spells it)."""
    if max_graphs < 0:
        raise ValueError(f"{name}={max_graphs}: must be >= 0 (0 turns CUDA graphs off)")


def rank_cuda_graphs(requested: int | None, *, gpu: bool, elastic: bool, batch_invariant: bool) -> int:
    """The graph count a rank is built with: ``requested`` as given (the launcher refused the combinations that
    cannot work), or, unset, ``DEFAULT_CUDA_GRAPHS`` where the rank can replay graphs — on a GPU, in a group
    that never re-plans (an elastic group's re-plan changes the copies a graph would replay) and without
    ``--batch-invariant`` (its attention reads the packed sequences on the host) — else 0."""
    if requested is not None:
        return requested
    return DEFAULT_CUDA_GRAPHS if gpu and not elastic and not batch_invariant else 0


@dataclass
class GraphCounters:
    """What a rank's prefill graphs did (``Engine.stats``, ``/healthz`` per rank, ``/metrics``)."""

    captured: int = 0   # shapes captured (at most max_graphs)
    replayed: int = 0   # forwards replayed, each capture's own forward included
    failed: int = 0     # captures that failed (their shapes run eagerly)
    eager: int = 0      # forwards run eagerly: warm-ups, shapes past max_graphs, failed shapes

    def as_dict(self) -> dict[str, int]:
        return {f"graphs_{k}": v for k, v in asdict(self).items()}


class Mode(enum.Enum):
    EAGER = "eager"
    CAPTURE = "capture"
    REPLAY = "replay"


class BucketPolicy:
    """Which way the next forward of a bucket runs (module docstring); host-only state, no device."""

    def __init__(self, max_graphs: int):
        check_max_graphs(max_graphs)
        self.max_graphs = max_graphs
        self._eager: dict[Bucket, int] = {}
        self._captured: set[Bucket] = set()
        self._failed: set[Bucket] = set()

    def decide(self, bucket: Bucket) -> Mode:
        if bucket in self._captured:
            return Mode.REPLAY
        if not self.may_capture(bucket):
            return Mode.EAGER
        return Mode.CAPTURE if self._eager.get(bucket, 0) >= WARMUP_FORWARDS else Mode.EAGER

    def may_capture(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` has or can still get a graph (else its batches run eagerly, unpadded)."""
        return bucket in self._captured or (bucket not in self._failed and len(self._captured) < self.max_graphs
                                            and len(self._failed) < MAX_FAILED_CAPTURES)

    def ran_eager(self, bucket: Bucket) -> None:
        if bucket not in self._captured and len(self._captured) < self.max_graphs:
            self._eager[bucket] = min(self._eager.get(bucket, 0) + 1, WARMUP_FORWARDS)

    def captured(self, bucket: Bucket) -> None:
        self._captured.add(bucket)
        self._eager.pop(bucket, None)

    def capture_failed(self, bucket: Bucket) -> None:
        self._failed.add(bucket)
        self._eager.pop(bucket, None)

    @property
    def num_captured(self) -> int:
        return len(self._captured)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    input_ids: Any  # the static inputs the graph reads, [1, T] / [1, T] / [n]
    position_ids: Any
    last: Any
    logits: Any  # the static output, [n, vocab] on the device


class PrefillGraphs:
    """Plain packed prefill (``packing.packed_logits``'s result) through per-bucket CUDA graphs."""

    def __init__(self, model, device, *, max_graphs: int, manager=None):
        import torch

        self.model, self.device, self.manager = model, torch.device(device), manager
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self.policy = BucketPolicy(max_graphs)
        #: padding never runs a sequence past the model's positions (graph_buckets.bucket_for)
        self.max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self._graphs: dict[Bucket, _Graph] = {}
        self._pool = None  # the graphs' one memory pool (module docstring), from the first capture
        self.counters = GraphCounters()

    def logits(self, sequences: Sequence[Sequence[int]]):
        """Last-position logits ``[len(sequences), vocab]``, float32 on the CPU."""
        n = len(sequences)
        bucket = bucket_for([len(s) for s in sequences], self.max_positions)
        if bucket is None or not self.policy.may_capture(bucket):
            self.counters.eager += 1
            return device_logits(self.model, *pack(sequences, self.device)).float().cpu()
        input_ids, position_ids, last = pack(sequences, self.device, tokens=bucket.tokens, rows=bucket.sequences)
        mode = self.policy.decide(bucket)
        if mode is not Mode.EAGER and self.manager is not None and self.manager.mid_sequence():
            mode = Mode.EAGER  # an aborted forward left the schedule mid-way: the eager forward restarts it
        if mode is Mode.CAPTURE:
            graph = self._capture(bucket, input_ids, position_ids, last)
            if graph is not None:
                return self._replay(graph, n)
        elif mode is Mode.REPLAY:
            graph = self._graphs[bucket]
            graph.input_ids.copy_(input_ids)
            graph.position_ids.copy_(position_ids)
            graph.last.copy_(last)
            return self._replay(graph, n)
        self.policy.ran_eager(bucket)
        self.counters.eager += 1
        return device_logits(self.model, input_ids, position_ids, last)[:n].float().cpu()

    def _replay(self, graph: _Graph, n: int):
        if self.manager is not None:
            self.manager.join_copies()
        graph.graph.replay()
        self.counters.replayed += 1
        return graph.logits[:n].float().cpu()

    def _capture(self, bucket: Bucket, input_ids, position_ids, last) -> _Graph | None:
        import torch

        graph = torch.cuda.CUDAGraph()
        dwdp = contextlib.nullcontext()
        if self.manager is not None:
            self.manager.join_copies()  # eagerly, before torch's capture begins
            dwdp = self.manager.capture()
        # one sequence: `transformers` keeps the eager forward's causal attention kernel (attention)
        masks = attention.one_sequence() if bucket.sequences == 1 else contextlib.nullcontext()
        try:
            # thread_local: the capture forbids unsafe CUDA calls of this thread only (the HTTP front, the KV
            # service and the peer monitor run beside it)
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), dwdp, masks:
                logits = device_logits(self.model, input_ids, position_ids, last)
        except Exception as exc:  # noqa: BLE001 - a model that cannot be captured still serves, eagerly
            self.policy.capture_failed(bucket)
            self.counters.failed += 1
            log.warning("CUDA graph capture of %d tokens in %d sequences failed; that shape runs eagerly%s: %s",
                        bucket.tokens, bucket.sequences,
                        ", and so will every shape not captured yet (--cuda-graphs 0 turns the attempts off)"
                        if self.counters.failed >= MAX_FAILED_CAPTURES else "", exc)
            if self.manager is not None:
                self.manager.invalidate()  # the host schedule advanced through a forward that never ran
            return None
        self.policy.captured(bucket)
        self.counters.captured += 1
        if self._pool is None:
            self._pool = graph.pool()
        captured = _Graph(graph, input_ids, position_ids, last, logits)
        self._graphs[bucket] = captured
        return captured

    def close(self) -> None:
        """Free the graphs and their memory pools (before the DWDP manager unmaps what they copy)."""
        self._graphs.clear()
        self._pool = None
