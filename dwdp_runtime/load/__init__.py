"""Prefill load signals: what a worker front reports about its queue and capacity, and the math behind it.

  ``schema``     the typed, versioned record (``LoadReport``) served at ``GET /v1/load`` and read by the
                 operator's autoscaler; the Prometheus gauge names of the same signals (``LoadMetric``).
  ``decay``      exponentially decayed sums and rates (pure; the clock is an argument).
  ``estimator``  ``LoadEstimator``: decayed per-ISL-bucket prefill throughput, arrivals, drain time, TTFT
                 estimate, saturation — fed by the front with the lengths and times it already knows.

Pure Python (pydantic only): the operator image imports it without torch.
"""
