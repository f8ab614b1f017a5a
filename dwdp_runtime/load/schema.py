"""The prefill load record a worker front serves at ``GET /v1/load`` — one definition for the worker, the
operator's autoscaler, the fleet simulator and the Prometheus gauge names.

Invariants:
  * Versioned: ``schema_version`` is ``SCHEMA_VERSION``. Adding an optional field (with a default) keeps
    the version — every reader parses with ``extra="ignore"``, so an older operator reads a newer worker
    and a newer operator reads an older worker (missing fields take their defaults). Only a change of a
    field's meaning or type bumps the version; ``parse_report`` refuses a version it does not know
    (``None``: "no signal", never a misread number). The elastic-group work adds its health fields to
    this same record that way (a new optional sub-model, e.g. ``health``).
  * Units are in the names: ``*_tokens`` tokens, ``*_seconds`` seconds, ``*_per_second`` rates;
    ``offered_load`` and ``backlog_seconds`` are *rank-seconds* (per second, and in total): prefill
    work measured in the time one rank needs for it at its measured throughput.
  * Buckets are by prompt length (ISL): bucket i holds lengths in ``(ISL_BUCKET_EDGES[i-1],
    ISL_BUCKET_EDGES[i]]``, the last one everything longer (``isl_le`` None, "+Inf" in Prometheus),
    like a histogram's ``le``.
  * ``LoadMetric`` names follow the gateway conventions the worker already serves (docs/SERVING.md): a
    ``dwdp_`` prefix, ``num_…_waiting`` / ``num_…_running`` for what is queued / in a forward (as
    ``dwdp_num_requests_waiting``), base units in the suffix. The HPA/KEDA recipes use these names.
"""

from __future__ import annotations

from bisect import bisect_left
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

SCHEMA_VERSION = 1
#: upper bounds of the prompt-length buckets: powers of two from 1K (DWDP's context range) to 128K; a
#: forward's cost per token changes with length (attention is quadratic), so each bucket has its own rate
ISL_BUCKET_EDGES: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
NUM_BUCKETS = len(ISL_BUCKET_EDGES) + 1  # + the open bucket beyond the last edge


def isl_bucket(length: int) -> int:
    """The bucket index of a prompt of ``length`` tokens (0 … NUM_BUCKETS-1)."""
    return bisect_left(ISL_BUCKET_EDGES, length)


def bucket_edge(index: int) -> int | None:
    """The bucket's inclusive upper bound; None for the open last bucket."""
    return ISL_BUCKET_EDGES[index] if index < len(ISL_BUCKET_EDGES) else None


def bucket_label(index: int) -> str:
    edge = bucket_edge(index)
    return "+Inf" if edge is None else str(edge)


class LoadMetric(StrEnum):
    """Prometheus gauges of ``/metrics`` carrying the record's signals (names shared with the recipes)."""

    WAITING_TOKENS = "dwdp_num_prefill_tokens_waiting"        # prompt tokens admitted, not yet in a forward
    RUNNING_TOKENS = "dwdp_num_prefill_tokens_running"        # prompt tokens in a forward now
    TOKENS_PER_SECOND = "dwdp_prefill_tokens_per_second"      # {isl_le}: measured capacity per rank (decayed)
    OFFERED_LOAD = "dwdp_prefill_offered_load"                # rank-seconds of prefill arriving per second
    DRAIN_SECONDS = "dwdp_prefill_drain_seconds"              # time for the ready ranks to clear the queue
    TTFT_ESTIMATE = "dwdp_prefill_ttft_estimate_seconds"      # {isl_le}: TTFT of a new request of that length
    SATURATION = "dwdp_prefill_saturation"                    # 0..1: share of prefill capacity asked for


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class BucketLoad(_Model):
    """One prompt-length bucket of one front."""

    isl_le: int | None = Field(description="inclusive upper bound of the bucket's prompt lengths; null: beyond the last edge")
    tokens_per_second: float | None = Field(
        default=None, ge=0, description="one rank's prefill tokens/s on a long queue of this bucket's prompts, "
                                         "FIFO-packed, timed by forward_cost; null: no forward of it measured")
    weight_seconds: float = Field(default=0.0, ge=0, description="decayed forward-seconds of forwards carrying this bucket")
    arrival_tokens_per_second: float = Field(default=0.0, ge=0, description="prompt tokens of this bucket admitted per second (decayed)")
    mean_length: float | None = Field(default=None, gt=0, description="decayed mean length of this bucket's prompts; null: none seen")
    waiting_tokens: int = Field(default=0, ge=0, description="prompt tokens of this bucket admitted, not yet in a forward")
    running_tokens: int = Field(default=0, ge=0, description="prompt tokens of this bucket in a forward now")
    ttft_estimate_seconds: float | None = Field(
        default=None, ge=0, description="TTFT a new prompt of the bucket's upper length would see now; null: not "
                                         "measured, or the open bucket")


class ForwardCost(_Model):
    """A measured roofline of forwards, ``max(floor, a·tokens + b·pairs)`` (``forward_model`` fits it): one
    front's, or a fleet's weighted mean."""

    floor_seconds: float = Field(gt=0, description="the shortest forward: the expert prefetch every forward pays")
    seconds_per_token: float = Field(default=0.0, ge=0, description="compute cost per token above the floor")
    seconds_per_pair: float = Field(default=0.0, ge=0, description="compute cost per attention pair (Σ l² of a forward)")
    compute_fitted: bool = Field(default=False, description="forwards above the floor were seen (else: proportional beyond the largest)")
    max_tokens: float = Field(default=1.0, gt=0, description="largest forward seen, in tokens")
    max_pairs: float = Field(default=1.0, gt=0, description="largest forward seen, in attention pairs")
    weight: float = Field(default=0.0, ge=0, description="forwards behind the model (decayed)")

    def seconds(self, tokens: float, pairs: float) -> float:
        if self.compute_fitted:
            return max(self.floor_seconds, self.seconds_per_token * tokens + self.seconds_per_pair * pairs)
        return self.floor_seconds * max(1.0, tokens / self.max_tokens, pairs / self.max_pairs)


class TtftEstimate(_Model):
    isl: int = Field(ge=1, description="prompt length the estimate is for")
    seconds: float = Field(ge=0, description="queue drain time + the request's own forward")


class LoadReport(_Model):
    """``GET /v1/load`` of one worker front (one pod)."""

    schema_version: int = Field(default=SCHEMA_VERSION, description="bumped only when a field changes meaning")
    ready: bool = Field(default=False, description="the front's /readyz")
    draining: bool = Field(default=False, description="SIGTERM received: finishing admitted requests, taking none")
    ranks: int = Field(default=0, ge=0, description="ranks ready to take a forward")
    max_num_tokens: int | None = Field(default=None, ge=1, description="tokens one forward packs at most")
    forward_cost: ForwardCost | None = Field(default=None, description="the measured roofline of this front's "
                                             "forwards; null: no forward measured yet")
    waiting_requests: int = Field(default=0, ge=0, description="sequences waiting for a rank (new, or between steps)")
    running_requests: int = Field(default=0, ge=0, description="admitted sequences not waiting: in a forward")
    waiting_prefill_tokens: int = Field(default=0, ge=0)
    running_prefill_tokens: int = Field(default=0, ge=0)
    buckets: list[BucketLoad] = Field(default_factory=list)
    offered_load: float | None = Field(default=None, ge=0, description="rank-seconds of prefill arriving per second")
    backlog_seconds: float | None = Field(default=None, ge=0, description="rank-seconds of waiting and running prefill")
    drain_seconds: float | None = Field(default=None, ge=0, description="backlog_seconds / ranks")
    forward_seconds: float | None = Field(default=None, ge=0, description="decayed mean forward time")
    forward_cv: float | None = Field(default=None, ge=0, description="coefficient of variation of the forward times")
    busy_fraction: float = Field(default=0.0, ge=0, le=1, description="decayed share of rank time spent in forwards")
    saturation: float = Field(default=0.0, ge=0, le=1, description="share of prefill capacity that arrivals and queue ask for")
    ttft_estimate: TtftEstimate | None = None
    ttft_observed_seconds: float | None = Field(default=None, ge=0, description="decayed mean TTFT of answered requests")
    ttft_correction: float | None = Field(default=None, gt=0, description="observed ÷ predicted TTFT (decayed sums)")
    ttft_correction_weight: float = Field(default=0.0, ge=0, description="decayed count of requests behind ttft_correction")


def parse_report(raw: Any) -> LoadReport | None:
    """A report read off the wire, or None (not an object, a version this reader does not know, bad values)."""
    if not isinstance(raw, dict) or raw.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        return None
    try:
        return LoadReport.model_validate(raw)
    except ValidationError:
        return None
