"""Triton-free facts the kernel modules share: which activations the epilogues implement, whether Triton
runs in its CPU interpreter, whether the kernels can run on a device.

A leaf module (imports nothing of the project): the package ``__init__`` re-exports it and the kernel
modules import it directly, so the lazily imported ``moe`` never imports the package back.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

#: activations the GEMM 1 epilogue implements (transformers' ACT2FN names → the kernel's ACT code)
ACTIVATIONS: dict[str, int] = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "relu": 2}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: Any = "cuda") -> bool:
    """Triton is importable and can run on ``device``: a CUDA device, or the CPU under the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    import torch

    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available()
    return kind == "cpu" and interpreting()


#: ``(what, chosen, why)`` of every kernel choice logged in this process (``log_choice_once``)
LOGGED_CHOICES: set[tuple[str, str, str | None]] = set()


def log_choice_once(logger: logging.Logger, what: str, chosen: str, why: str | None) -> None:
    """One INFO line per distinct choice and reason in a process — the choices are made per layer and forward
    (``fp8_moe.chosen_backend``, ``w4a8_moe.chosen_kernel``), the line is written once."""
    key = (what, str(chosen), why)
    if key not in LOGGED_CHOICES:
        LOGGED_CHOICES.add(key)
        logger.info("%s run %s%s", what, chosen, f" ({why})" if why else "")
