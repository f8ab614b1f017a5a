"""Kernel tests on CPU: the Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).

The variable is set here, at collection, before any kernel module is imported (``triton.jit`` picks the
interpreter when a kernel is defined, and ``grouped_gemm`` decides its interpreter-only fp32 operand
path at import). Every test here is skipped when triton is not installed. Shapes are small: the
interpreter runs each program as numpy, so the whole folder stays around a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("triton") is not None:
        return
    skip = pytest.mark.skip(reason="triton is not installed (pip install -e '.[test]')")
    for item in items:
        if str(item.fspath).startswith(HERE + os.sep):
            item.add_marker(skip)
