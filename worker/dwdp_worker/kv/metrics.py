"""KV handoff metrics and the ``/healthz`` budget summary, read from the ranks' reported stats.

A rank's stats record (``protocol.RankStats.kv``, a ``store.KvStats``) carries its KV store counters; the
front shows them per rank in its snapshot (``/healthz`` ``ranks[i].kv``) and this module turns that into
Prometheus families at scrape time — exactly what the ranks reported, never re-counted — and into the budget
summary of ``/healthz``.

Names (prefixed ``dwdp_kv_``, label ``rank``):
  budget_bytes                 gauge    size of the rank's registered KV region
  held_bytes / held_sequences  gauge    KV waiting for a decode engine (held_bytes counts quarantined blocks)
  quarantined_bytes            gauge    blocks waiting out the grace period after a lapsed lease or an abort
  stored_total                 counter  sequences whose KV was kept
  pulls_total                  counter  pulls confirmed by the decode side (freed at once)
  pulled_bytes_total           counter  bytes of those pulls
  pull_seconds_total           counter  claim → completion notification, summed
                                        (pull bandwidth = rate(pulled_bytes) / rate(pull_seconds))
  expirations_total            counter  KV freed unclaimed after its TTL, or after a lapsed pull lease
  refusals_total               counter  claims refused (unknown / expired / lapsed / already pulled / protocol)
  stale_total                  counter  pulled confirmations answered stale (the decode side discards its READ)
  full_total                   counter  sequences refused for a full budget (answered 429)
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

GAUGES = {"budget_bytes": "size of the registered KV region", "held_bytes": "KV bytes held for decode engines",
          "held_sequences": "sequences whose KV is held",
          "quarantined_bytes": "KV blocks waiting out the grace period after a lapsed lease or an abort"}
COUNTERS = {"stored": "sequences whose KV was kept", "pulls": "pulls confirmed by the decode side",
            "pulled_bytes": "bytes of confirmed pulls", "pull_seconds": "claim to completion, summed",
            "expirations": "KV freed unclaimed after its TTL or a lapsed pull lease",
            "refusals": "claims refused", "stale": "pulled confirmations answered stale",
            "full": "sequences refused for a full KV budget"}


def budget_summary(ranks: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """``/healthz`` ``kv``: budget use summed over the ranks that have a KV region (None when none has)."""
    per = [r["kv"] for r in ranks if r.get("kv")]
    if not per:
        return None
    budget = sum(int(k.get("budget_bytes", 0)) for k in per)
    held = sum(int(k.get("held_bytes", 0)) for k in per)
    return {"budget_bytes": budget, "held_bytes": held, "use": round(held / budget, 4) if budget else 0.0,
            "held_sequences": sum(int(k.get("held_sequences", 0)) for k in per),
            "pulls": sum(int(k.get("pulls_total", 0)) for k in per),
            "expirations": sum(int(k.get("expirations_total", 0)) for k in per),
            "stale": sum(int(k.get("stale_total", 0)) for k in per)}


class KvCollector:
    """A ``prometheus_client`` collector over the front's snapshot (``snap["ranks"][i]["kv"]``)."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gauges = {k: GaugeMetricFamily(f"dwdp_kv_{k}", doc, labels=["rank"]) for k, doc in GAUGES.items()}
        counters = {k: CounterMetricFamily(f"dwdp_kv_{k}", doc, labels=["rank"]) for k, doc in COUNTERS.items()}
        for r in self._snapshot().get("ranks", []):
            kv = r.get("kv")
            if not kv:
                continue
            label = [str(r["global_id"])]
            for k, fam in gauges.items():
                fam.add_metric(label, float(kv.get(k, 0)))
            for k, fam in counters.items():
                fam.add_metric(label, float(kv.get(f"{k}_total", 0)))
        yield from gauges.values()
        yield from counters.values()
