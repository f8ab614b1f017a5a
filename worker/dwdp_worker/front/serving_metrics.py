"""Model-server protocol metrics (the Gateway API Inference Extension's endpoint picker reads these).

Same meaning as vLLM's, under our own ``dwdp_`` prefix (the picker's metric names are flags; see
docs/SERVING.md for the flags that point at ours):

  ours                                        vLLM                                  type
  dwdp_num_requests_waiting                   vllm:num_requests_waiting             gauge
  dwdp_num_requests_running                   vllm:num_requests_running             gauge
  dwdp_kv_cache_usage_perc                    vllm:kv_cache_usage_perc              gauge (0..1; only with a KV store)
  dwdp_prompt_tokens_total                    vllm:prompt_tokens_total              counter
  dwdp_generation_tokens_total                vllm:generation_tokens_total          counter
  dwdp_time_to_first_token_seconds            vllm:time_to_first_token_seconds      histogram
  dwdp_request_success_total{finished_reason} vllm:request_success_total{finished_reason}  counter

Prefill load gauges (``dwdp_runtime.load.schema.LoadMetric``, the same signals as ``GET /v1/load``; the
autoscaling recipes of docs/OPERATOR.md read them), read from the front's ``LoadReport`` at scrape time:

  dwdp_num_prefill_tokens_waiting / _running          gauge   prompt tokens queued / in a forward
  dwdp_prefill_tokens_per_second{isl_le}              gauge   measured per-rank throughput of that bucket
  dwdp_prefill_offered_load                           gauge   rank-seconds of prefill arriving per second
  dwdp_prefill_drain_seconds                          gauge   time for the ready ranks to clear the queue
  dwdp_prefill_ttft_estimate_seconds{isl_le}          gauge   TTFT a new prompt of that length would see
  dwdp_prefill_saturation                             gauge   0..1

Invariants:
  * *Requests*, not steps: a request with a list of 3 prompts counts 3 (one per sequence, like vLLM);
    ``waiting`` = admitted and not yet in any forward, ``running`` = in or between its forwards. Both
    are read from the front's own job set at scrape time (``RequestLoad``), so they cannot drift.
  * ``kv_cache_usage_perc`` is exported only when the front has a KV store to measure (``None``
    otherwise): a constant 0 would tell a picker this pod has free cache it does not have.
  * Token counters and successes count only answered requests (a 4xx/5xx counts nothing here; see
    ``dwdp_requests_total{code}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from dwdp_runtime.load.schema import LoadMetric, LoadReport, bucket_label

# From vLLM's TTFT buckets trimmed to a context server's range (a prefill answer is its first token).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
FINISHED_REASONS = ("stop", "length")


@dataclass(frozen=True)
class RequestLoad:
    waiting: int
    running: int
    kv_cache_usage: float | None = None  # fraction 0..1 of the KV budget in use; None without a KV store


class _LoadCollector:
    def __init__(self, load: Callable[[], RequestLoad]):
        self._load = load

    def collect(self):
        load = self._load()
        for name, value, doc in (("dwdp_num_requests_waiting", load.waiting,
                                  "requests admitted and not yet in a forward (vllm:num_requests_waiting)"),
                                 ("dwdp_num_requests_running", load.running,
                                  "requests in or between their forwards (vllm:num_requests_running)")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        if load.kv_cache_usage is not None:
            g = GaugeMetricFamily("dwdp_kv_cache_usage_perc", "fraction of the KV budget in use, 0..1 "
                                  "(vllm:kv_cache_usage_perc)")
            g.add_metric([], float(load.kv_cache_usage))
            yield g


class _PrefillLoadCollector:
    """The ``LoadReport`` as gauges; a signal the front cannot estimate yet (nothing measured) is absent."""

    def __init__(self, report: Callable[[], LoadReport]):
        self._report = report

    def collect(self):
        r = self._report()
        scalars = ((LoadMetric.WAITING_TOKENS, r.waiting_prefill_tokens, "prompt tokens admitted, not yet in a forward"),
                   (LoadMetric.RUNNING_TOKENS, r.running_prefill_tokens, "prompt tokens in a forward now"),
                   (LoadMetric.OFFERED_LOAD, r.offered_load, "rank-seconds of prefill arriving per second"),
                   (LoadMetric.DRAIN_SECONDS, r.drain_seconds, "seconds for the ready ranks to clear the queue"),
                   (LoadMetric.SATURATION, r.saturation, "share of prefill capacity asked for, 0..1"))
        for name, value, doc in scalars:
            if value is not None:
                g = GaugeMetricFamily(str(name), doc)
                g.add_metric([], float(value))
                yield g
        tput = GaugeMetricFamily(str(LoadMetric.TOKENS_PER_SECOND), "measured prefill tokens/s of one rank, by "
                                 "prompt-length bucket (decayed)", labels=["isl_le"])
        ttft = GaugeMetricFamily(str(LoadMetric.TTFT_ESTIMATE), "TTFT a new prompt of the bucket's length would "
                                 "see now", labels=["isl_le"])
        for i, b in enumerate(r.buckets):
            if b.tokens_per_second:
                tput.add_metric([bucket_label(i)], b.tokens_per_second)
            if b.ttft_estimate_seconds is not None:
                ttft.add_metric([bucket_label(i)], b.ttft_estimate_seconds)
        yield tput
        yield ttft


class ServingMetrics:
    """Registers the model-server metrics in ``registry``; the front observes answered requests."""

    def __init__(self, registry: CollectorRegistry, load: Callable[[], RequestLoad],
                 prefill: Callable[[], LoadReport] | None = None):
        self.prompt_tokens = Counter("dwdp_prompt_tokens", "prompt tokens of answered requests "
                                     "(vllm:prompt_tokens_total)", registry=registry)
        self.generation_tokens = Counter("dwdp_generation_tokens", "generated tokens of answered requests "
                                         "(vllm:generation_tokens_total)", registry=registry)
        self.ttft = Histogram("dwdp_time_to_first_token_seconds", "admission to the first generated token "
                              "(vllm:time_to_first_token_seconds)", buckets=TTFT_BUCKETS, registry=registry)
        self.success = Counter("dwdp_request_success", "answered requests by finish reason "
                               "(vllm:request_success_total)", ["finished_reason"], registry=registry)
        for reason in FINISHED_REASONS:
            self.success.labels(finished_reason=reason)  # present from the first scrape, at 0
        registry.register(_LoadCollector(load))
        if prefill is not None:
            registry.register(_PrefillLoadCollector(prefill))

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def answered(self, *, prompt_tokens: int, generated_tokens: int, finished_reason: str) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated_tokens)
        self.success.labels(finished_reason=finished_reason).inc()
