"""Prometheus metrics of one front (its own ``CollectorRegistry``: several fronts may share a process).

Event metrics are observed by the front as requests and batches complete; per-rank engine counters
(prefetch bytes, restarts, forwards) are read from the latest rank stats at scrape time by a
custom collector, so they are exactly what the ranks reported, never re-counted.

Names (all prefixed ``dwdp_``):
  requests_total{code}                 counter    answered requests by HTTP status
  request_latency_seconds              histogram  admission → answer, successful completions
  queue_wait_seconds                   histogram  admission → first forward
  forward_seconds                      histogram  one packed forward as seen by the front
  batch_sequences / batch_tokens       histogram  packing: sequences and tokens per forward
  queue_depth / queue_tokens           gauge      steps waiting for a rank
  inflight_requests                    gauge      admitted, not yet answered
  prefetch_bytes_total{rank}           counter    expert bytes pulled from peers (rank stats)
  prefetch_wait_seconds_total{rank}    counter    exposed prefetch wait (sum over forwards)
  compute_seconds_total{rank}          counter    rank compute time (sum over forwards)
  prefetch_restarts_total{rank}        counter    prefetch schedule restarts (rank stats)
  forwards_total{rank}                 counter    engine forwards incl. warm-up (rank stats)
  remote_bytes_per_forward{rank}       gauge      remote expert bytes one forward pulls
  prefill_graph_replays_total{rank}    counter    prefill forwards replayed from CUDA graphs (--cuda-graphs)
  prefill_graph_failures_total{rank}   counter    CUDA-graph captures that failed (those shapes run eagerly)
  rank_ready{rank} / ready / draining / group_attempt   gauge
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..kv.metrics import KvCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 8192, 16384, 32768, 65536)


class _RankCollector:
    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        fams = {
            "prefetch_bytes": CounterMetricFamily("dwdp_prefetch_bytes", "expert bytes pulled from peers", labels=["rank"]),
            "prefetch_wait_s": CounterMetricFamily("dwdp_prefetch_wait_seconds", "exposed prefetch wait", labels=["rank"]),
            "compute_s": CounterMetricFamily("dwdp_compute_seconds", "rank compute time", labels=["rank"]),
            "prefetch_restarts": CounterMetricFamily("dwdp_prefetch_restarts", "prefetch schedule restarts", labels=["rank"]),
            "forwards": CounterMetricFamily("dwdp_forwards", "engine forwards including warm-up", labels=["rank"]),
        }
        graphs = {"replayed": CounterMetricFamily("dwdp_prefill_graph_replays", "prefill forwards replayed from CUDA graphs",
                                                  labels=["rank"]),
                  "failed": CounterMetricFamily("dwdp_prefill_graph_failures", "CUDA-graph captures that failed",
                                                labels=["rank"])}
        remote = GaugeMetricFamily("dwdp_remote_bytes_per_forward", "remote expert bytes per forward", labels=["rank"])
        ready = GaugeMetricFamily("dwdp_rank_ready", "1 when the rank is ready", labels=["rank"])
        for r in snap["ranks"]:
            label = [str(r["global_id"])]
            for key, fam in fams.items():
                fam.add_metric(label, float(r.get(key) or 0))
            for key, fam in graphs.items():
                fam.add_metric(label, float((r.get("prefill_graphs") or {}).get(key) or 0))
            remote.add_metric(label, float(r.get("remote_bytes_per_forward") or 0))
            ready.add_metric(label, 1.0 if r["phase"] == "ready" and r["alive"] else 0.0)
        yield from fams.values()
        yield from graphs.values()
        yield remote
        yield ready
        for name, value, doc in (("dwdp_ready", snap.get("ready", False), "1 when /readyz is true"),
                                 ("dwdp_draining", snap.get("draining", False), "1 while draining"),
                                 ("dwdp_group_attempt", snap.get("group_attempt", 0), "group attempt")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g


class Metrics:
    def __init__(self, snapshot: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("dwdp_requests", "answered requests by HTTP status", ["code"], registry=r)
        self.latency = Histogram("dwdp_request_latency_seconds", "admission to answer", buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram("dwdp_queue_wait_seconds", "admission to first forward", buckets=LATENCY_BUCKETS, registry=r)
        self.forward = Histogram("dwdp_forward_seconds", "one packed forward seen by the front", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_sequences = Histogram("dwdp_batch_sequences", "sequences per forward", buckets=SIZE_BUCKETS, registry=r)
        self.batch_tokens = Histogram("dwdp_batch_tokens", "tokens per forward", buckets=TOKEN_BUCKETS, registry=r)
        self.queue_depth = Gauge("dwdp_queue_depth", "steps waiting for a rank", registry=r)
        self.queue_tokens = Gauge("dwdp_queue_tokens", "tokens waiting for a rank", registry=r)
        self.inflight = Gauge("dwdp_inflight_requests", "admitted, not yet answered", registry=r)
        self.rank_loss = Counter("dwdp_rank_loss_requests", "requests on a rank lost by an elastic group, by outcome "
                                 "(rerun on a survivor, or refused 503 with the cause)", ["outcome"], registry=r)
        self.membership_epoch = Gauge("dwdp_membership_epoch", "membership epoch of the elastic group", ["group"],
                                      registry=r)
        self.coverage_margin = Gauge("dwdp_coverage_margin", "minimum surviving holders per expert of the elastic "
                                     "group (set at its first rank loss; 0 = an expert has no copy left)", ["group"],
                                     registry=r)
        self.experts_reloaded = Counter("dwdp_experts_reloaded", "experts ranks of the group read back from the "
                                        "checkpoint after a loss left them without a holder (summed over ranks)",
                                        ["group"], registry=r)
        self.members_ready = Gauge("dwdp_members_ready", "ranks of the group still serving", ["group"], registry=r)
        self.replans = Counter("dwdp_replans", "membership epochs applied by this front's ranks (each a re-plan of "
                               "every layer's copies between two forwards), by group", ["group"], registry=r)
        self.replan_seconds = Histogram("dwdp_replan_seconds", "time one rank spent applying a membership epoch "
                                        "(drop, import, re-plan), between two forwards", ["group"],
                                        buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2.0, 10.0), registry=r)
        self.rank_respawns = Counter("dwdp_rank_respawns", "processes this front started again for a rank its elastic "
                                     "group lost (a replacement that rejoins)", ["group"], registry=r)
        self.rank_rejoins = Counter("dwdp_rank_rejoins", "replacements of lost ranks admitted back into their elastic "
                                    "group (the group full again)", ["group"], registry=r)
        self.store_failovers = Counter("dwdp_store_failovers", "moves of the group's store to a survivor's standby "
                                       "after its host was lost", ["group"], registry=r)
        self.store_generation = Gauge("dwdp_store_generation", "failover generation of the group's store (0: the "
                                      "primary, rank 0's)", ["group"], registry=r)
        r.register(_RankCollector(snapshot))
        r.register(KvCollector(snapshot))  # dwdp_kv_*: KV handoff, from the ranks' stats

    def render(self) -> bytes:
        return generate_latest(self.registry)
