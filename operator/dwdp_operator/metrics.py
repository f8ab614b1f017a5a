"""Prometheus metrics of the operator (exposed by ``dwdp-operator --metrics-port``)."""

from prometheus_client import Counter, Histogram

RECONCILES = Counter("dwdp_operator_reconciles_total", "reconciles run", ["result"])
RECONCILE_SECONDS = Histogram("dwdp_operator_reconcile_seconds", "wall time of one reconcile",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
CHILDREN = Counter("dwdp_operator_children_total", "child objects written", ["action"])
EVENTS = Counter("dwdp_operator_events_total", "Events posted", ["reason"])
