"""bench/profiling.py: the device-busy figure counts each kernel once (a CPU op's device time is its kernels')."""

from __future__ import annotations

import pathlib
import sys
from types import SimpleNamespace

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def test_a_kernel_launched_by_an_op_is_counted_once():
    from torch.autograd import DeviceType

    from bench.profiling import device_time_us

    op = SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=40.0, is_user_annotation=False)
    kernel = SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=40.0, is_user_annotation=False)
    mark = SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=40.0, is_user_annotation=True)
    assert sum(device_time_us(e) for e in (op, kernel, mark)) == 40.0
    older = SimpleNamespace(device_type=DeviceType.CUDA, self_cuda_time_total=7.0)  # torch before the rename
    assert device_time_us(older) == 7.0
