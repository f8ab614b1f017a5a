"""Kernel tests on CPU: the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).

The variable is set here, at collection, before any kernel module is imported (``triton.jit`` picks the
interpreter when a kernel is defined, and ``grouped_gemm`` decides its interpreter-only paths at import)
— but only on a machine without CUDA: a GPU run (``pytest -m gpu`` collects this folder too) must
compile the kernels for the GPU, so there these tests are skipped and tests/gpu/test_kernels_gpu.py
runs the real ones. Every test here is skipped when triton is not installed. Shapes are small: the
interpreter runs each program as numpy, so the whole folder stays well under a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("triton") is None:
        reason = "triton is not installed (pip install -e '.[test]')"
    elif os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        reason = "CPU-interpreter tests (TRITON_INTERPRET=1); on a GPU the kernels run in tests/gpu"
    else:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if str(item.fspath).startswith(HERE + os.sep):
            item.add_marker(skip)
