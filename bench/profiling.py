"""torch.profiler tables for the benches: one callable profiled once, its kernels sorted by device time.

``profile_table(fn, device)`` runs ``fn`` under the profiler (CPU and, on CUDA, device activity; the device is
synchronised inside the profiled region so every kernel lands in it) and returns the ``key_averages`` table and
the device-busy figure beside the wall time: where the wall exceeds the summed kernel time, the host (launches,
Python) or waits left the GPU idle. The device-time attribute changed name across torch releases
(``self_cuda_time_total`` → ``self_device_time_total``); both are tried.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

#: torch's names for an event's own device time, newest first (torch 2.4 renamed cuda → device)
DEVICE_TIME_KEYS = ("self_device_time_total", "self_cuda_time_total")


@dataclass(frozen=True)
class ProfileResult:
    table: str          # key_averages table, sorted by device time (CPU time where there is no device)
    wall_s: float       # wall time of the profiled call, device synchronised
    device_busy_s: float  # summed time of the device's own events: kernels, copies (0 on CPU; overlapping streams add)


def _device_time_us(event) -> float:
    """An event's own device time, counted only for the device's events (kernels, copies): a CPU op's device
    time is its kernels' again — torch's own table totals count them this way."""
    from torch.autograd import DeviceType

    if event.device_type != DeviceType.CUDA or getattr(event, "is_user_annotation", False):
        return 0.0
    for key in DEVICE_TIME_KEYS:
        value = getattr(event, key, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_table(fn: Callable[[], object], device, *, rows: int = 20, trace: str | None = None) -> ProfileResult:
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.key_averages()
    busy = sum(_device_time_us(e) for e in events) / 1e6 if on_cuda else 0.0
    for key in (DEVICE_TIME_KEYS + ("cuda_time_total",) if on_cuda else ("self_cpu_time_total",)):
        try:
            table = events.table(sort_by=key, row_limit=rows, max_name_column_width=70)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    else:
        table = events.table(row_limit=rows)
    return ProfileResult(table=table, wall_s=wall, device_busy_s=busy)
