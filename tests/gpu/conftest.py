"""GPU tests: every test here is marked ``gpu`` and skipped (with the reason) where CUDA is absent.

Run them on a GPU machine with ``pytest -m gpu tests/gpu``. CPU CI collects this folder without
touching CUDA: torch is imported lazily and nothing here needs cuda-python at import time.
"""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Rank programs (gpu_workloads) and the process harness (tests/runtime/group.py) must be importable
# by name in spawned processes, which inherit sys.path from this one.
for path in (HERE, os.path.join(os.path.dirname(HERE), "runtime")):
    if path not in sys.path:
        sys.path.insert(0, path)


def cuda_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible (run on a GPU machine: pytest -m gpu)"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "cuda-python is not installed (pip install cuda-python)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = None
    checked = False
    for item in items:
        if not str(item.fspath).startswith(HERE + os.sep):
            continue
        item.add_marker(pytest.mark.gpu)
        if not checked:
            reason, checked = cuda_skip_reason(), True
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def cuda_device():
    import torch

    torch.cuda.set_device(0)
    return torch.device("cuda", 0)
