"""Calibration: measured kernel/copy times against the planner's prediction for the same shapes.

Pure. ``calibrate(measured)`` takes a dict:

    {"hardware": "h200-hgx",
     "grouped_gemm": [{"name": str, "num_experts": E, "k": K, "n": N, "tokens": rows, "dtype": "bf16",
                       "time_s": [lo, hi]}],            # one grouped GEMM [rows, K] x E×[K, N]
     "copy": [{"name": str, "nbytes": bytes, "bytes_per_s": [lo, hi]}]}   # one peer-to-peer copy

and returns, per item, the prediction, the measured range and the relative error
``(predicted - measured) / measured`` of the *time* at both ends of the range and at its
midpoint (negative: the planner is optimistic). A range may be a single number.

``H200_MEASURED`` holds the published H200 measurements (docs/DRIVER_FACTS.md, measured 2026-11-29):
grouped GEMM 64 experts 2048→1024, 8192 tokens: 0.11–0.15 ms; copy-engine NVLink copy of
2 GiB: 388–394 GB/s. Caveat: the H200 link efficiency (presets) was fitted to that same copy
measurement, so the copy row checks consistency, not predictive power. When the CUDA-backend
benchmarks exist, feed their JSON here (same keys).
"""

from __future__ import annotations

from . import roofline
from .presets import GIB, get_dtype, get_hardware

H200_MEASURED: dict = {
    "hardware": "h200-hgx",
    "grouped_gemm": [{"name": "grouped_mm 64 experts 2048->1024, 8192 tokens (bf16)", "num_experts": 64,
                      "k": 2048, "n": 1024, "tokens": 8192, "dtype": "bf16", "time_s": [0.11e-3, 0.15e-3]}],
    "copy": [{"name": "copy_ peer->local pool pages over NVLink, 2 GiB", "nbytes": 2 * GIB,
              "bytes_per_s": [388e9, 394e9]}],
}


def _range(v) -> tuple[float, float]:
    if isinstance(v, (int, float)):
        return float(v), float(v)
    lo, hi = v
    return float(lo), float(hi)


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def calibrate(measured: dict) -> dict:
    hw = get_hardware(measured.get("hardware", "h200-hgx"))
    items = []
    for g in measured.get("grouped_gemm", []):
        dt = get_dtype(g.get("dtype", "bf16"))
        op = roofline.grouped_gemm("grouped_gemm", g["tokens"], g["k"], g["n"],
                                   touched=g.get("touched", g["num_experts"]), w_bytes=dt.bytes_per_element,
                                   peak=hw.peak(dt.compute), bw=hw.hbm_bytes_per_s)
        lo, hi = _range(g["time_s"])
        items.append({"kind": "grouped_gemm", "name": g.get("name", "grouped_gemm"), "bound": op.bound,
                      "predicted_s": op.time, "measured_s": [lo, hi],
                      "predicted_tflops": op.flops / op.time / 1e12,
                      "measured_tflops": [op.flops / hi / 1e12, op.flops / lo / 1e12]})
    for c in measured.get("copy", []):
        lo_bw, hi_bw = _range(c["bytes_per_s"])
        pred = c["nbytes"] / hw.link_bytes_per_s
        # slow end of the bandwidth range = long end of the time range
        items.append({"kind": "copy", "name": c.get("name", "copy"), "bound": "link",
                      "predicted_s": pred, "measured_s": [c["nbytes"] / hi_bw, c["nbytes"] / lo_bw],
                      "predicted_bytes_per_s": hw.link_bytes_per_s, "measured_bytes_per_s": [lo_bw, hi_bw]})
    for it in items:
        lo, hi = it["measured_s"]
        mid = (lo + hi) / 2
        it["error"] = {"vs_fastest": _err(it["predicted_s"], lo), "vs_slowest": _err(it["predicted_s"], hi),
                       "vs_mid": _err(it["predicted_s"], mid)}
    return {"hardware": hw.name, "items": items}


def format_report(result: dict) -> str:
    lines = [f"calibration on {result['hardware']} (error = (predicted - measured) / measured time)"]
    for it in result["items"]:
        lo, hi = it["measured_s"]
        e = it["error"]
        lines.append(f"  {it['name']}: predicted {it['predicted_s'] * 1e6:.1f} µs ({it['bound']}-bound), "
                     f"measured {lo * 1e6:.1f}–{hi * 1e6:.1f} µs, error {e['vs_slowest']:+.1%} … "
                     f"{e['vs_fastest']:+.1%} (mid {e['vs_mid']:+.1%})")
    return "\n".join(lines)
