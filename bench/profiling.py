"""torch.profiler tables for the benches: one callable profiled once, its kernels sorted by device time.

``profile_table(fn, device)`` runs ``fn`` under the profiler (CPU and, on CUDA, device activity; the device is
synchronised inside the profiled region so every kernel lands in it) and returns the ``key_averages`` table and
the device-busy figure beside the wall time: where the wall exceeds the summed kernel time, the host (launches,
Python) or waits left the GPU idle. The device-time attribute changed name across torch releases
(``self_cuda_time_total`` → ``self_device_time_total``); both are tried.

``host_profile(fn)`` is the host's side of the same question: ``fn`` run a few times under ``cProfile``, the
functions that took the host's time, by their own time (where a forward is host-bound, which Python work it is).
"""

from __future__ import annotations

import cProfile
import io
import pstats
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


def device_time_us(event) -> float:
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
    busy = sum(device_time_us(e) for e in events) / 1e6 if on_cuda else 0.0
    for key in (DEVICE_TIME_KEYS + ("cuda_time_total",) if on_cuda else ("self_cpu_time_total",)):
        try:
            table = events.table(sort_by=key, row_limit=rows, max_name_column_width=70)
            break
        except (AttributeError, KeyError, ValueError):
            continue
    else:
        table = events.table(row_limit=rows)
    return ProfileResult(table=table, wall_s=wall, device_busy_s=busy)


#: a regular expression of the project's own modules (``host_profile`` lists them apart)
OWN_MODULES = r"dwdp_runtime|dwdp_worker"
#: runs of the callable under cProfile: one forward's host time is a few ms, three smooth out a stray stall
HOST_PROFILE_REPEATS = 3


def host_profile(fn: Callable[[], object], device, *, repeats: int = HOST_PROFILE_REPEATS, rows: int = 25) -> str:
    """``fn`` run ``repeats`` times under ``cProfile`` (the device synchronised after each, inside the profile):
    the ``rows`` functions with the most own host time, and the cumulative listing of the same run."""
    import torch

    on_cuda = torch.device(device).type == "cuda"
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(repeats):
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    # the project's own functions apart: the DWDP hooks and the MoE launch path, however small their share
    stats.sort_stats("cumulative").print_stats(OWN_MODULES, rows)
    return out.getvalue()
