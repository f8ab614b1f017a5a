"""GPU tests: every test here is marked ``gpu`` and skipped (with the reason) where CUDA is absent.

Run them on a GPU machine with ``pytest -m gpu tests/gpu``. CPU CI collects this folder without
touching CUDA: torch is imported lazily and nothing here needs cuda-python at import time.
"""

from __future__ import annotations

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
# Rank programs (tests.gpu.gpu_workloads) are imported by their package name in spawned processes:
# tests/ is a package, so pytest puts the repository root on sys.path and the children inherit it.


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


@pytest.fixture(scope="module")
def fp8_cute():
    """``dwdp_runtime.kernels.fp8_cute``, or the test skipped naming why the CuTe FP8 kernels cannot run here."""
    from dwdp_runtime.kernels import fp8_cute

    why = fp8_cute.unavailable()
    if why:
        pytest.skip(f"CuTe FP8 path unavailable: {why}")
    return fp8_cute


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
