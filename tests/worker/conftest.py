"""Fixtures for the worker tests: one synthetic checkpoint per architecture per session.

The repository root and ``worker/`` go first on ``sys.path`` so this checkout's packages are imported
(also by ``spawn``ed rank processes, which inherit ``sys.path``).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from dwdp_worker.synth import SUPPORTED_ARCHS, write_synthetic  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Tiny float32 checkpoints (8 experts, 3 layers incl. a dense one where the arch has them)."""
    base = tmp_path_factory.mktemp("ckpt")
    return {a: write_synthetic(a, base / a, seed=7, tokenizer=(a == "qwen3_moe")) for a in SUPPORTED_ARCHS}
