"""``--batch-invariant``: route the process's dense GEMMs through ``bi_matmul`` so logits do not depend on the batch.

``enable(device_type) -> BatchInvariantMode``; ``mode.close()`` undoes it (idempotent; also a context manager).

What it changes: the dispatcher's kernels of ``aten::mm``, ``aten::addmm`` and ``aten::bmm`` for one device type
(``torch.library`` IMPL registrations on the ``CUDA`` key; ``CPU`` only in tests under Triton's interpreter).
Every ``nn.Linear``, router ``F.linear`` and ``lm_head`` of a `transformers` model reaches one of those three
(``aten::linear`` and ``aten::matmul`` are composite: they decompose into them), so one registration covers the
attention projections, the dense MLP, shared experts, routers and the LM head of every architecture — no
per-model list of modules to keep in sync. Our experts kernels are batch invariant already (docs/KERNELS.md).
Attention is not a GEMM of this dispatcher: a sequence alone runs SDPA's causal kernel, packed the masked one
(other bits: H200, 2026-12-04, qwen3_moe / mixtral 0.03 apart with these GEMMs on), so the worker's
``--batch-invariant`` also runs attention per packed sequence (``dwdp_worker.model.attention``, installed by
``attach``); ``tests/gpu/test_batch_invariant_gpu.py`` checks the whole model and names the first module that
breaks it.

Scope: **process-wide** for that device type (a rank process serves one model, so the engine enables it at build
and closes it with the engine). Operands the kernel does not cover (integer,
complex or mixed dtypes: none a model feeds a dense GEMM) raise — ``torch.library`` has no call into the
kernel registered before ours on the same key; closing the library restores that kernel. Nested
``enable`` calls share one registration (reference counted): the last ``close`` removes it.

Cost: a fixed 128×128×64 tiling cannot be the fastest for every M (cuBLAS picks per shape); ``bench/batch_invariant.py``
reports the slowdown per GEMM shape and per prefill.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

#: the aten ops whose device kernels are replaced (every dense GEMM of a `transformers` forward reaches one)
OPS = ("mm", "addmm", "bmm")

_lock = threading.Lock()
_active: dict[str, "_Registration"] = {}


@dataclass
class _Registration:
    library: object
    owners: int = 0
    calls: dict[str, int] = field(default_factory=lambda: {op: 0 for op in OPS})


@dataclass
class BatchInvariantMode:
    """One owner of the registration for ``device_type``; ``calls`` counts GEMMs our kernel computed."""
    device_type: str
    closed: bool = False

    @property
    def calls(self) -> dict[str, int]:
        reg = _active.get(self.device_type)
        return dict(reg.calls) if reg is not None else {op: 0 for op in OPS}

    def close(self) -> None:
        with _lock:
            if self.closed:
                return
            self.closed = True
            reg = _active[self.device_type]
            reg.owners -= 1
            if reg.owners == 0:
                del _active[self.device_type]
                reg.library._destroy()  # the previous kernels of mm/addmm/bmm are the dispatcher's again

    def __enter__(self) -> "BatchInvariantMode":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def active(device_type: str = "cuda") -> bool:
    return device_type in _active


def enable(device_type: str = "cuda") -> BatchInvariantMode:
    """Register the batch-invariant GEMMs for ``device_type`` (module docstring). ``cpu`` needs the interpreter."""
    from .support import available

    if not available(device_type):
        raise RuntimeError(f"--batch-invariant: the Triton GEMM cannot run on {device_type!r} here (a CUDA GPU, "
                           f"or the CPU under TRITON_INTERPRET=1 for tests)")
    with _lock:
        reg = _active.get(device_type)
        if reg is None:
            reg = _Registration(library=_register(device_type))
            _active[device_type] = reg
        reg.owners += 1
    return BatchInvariantMode(device_type)


def _register(device_type: str):
    import torch

    from . import bi_matmul

    key = {"cuda": "CUDA", "cpu": "CPU"}[device_type]
    lib = torch.library.Library("aten", "IMPL")
    reg_calls = lambda: _active[device_type]  # noqa: E731  (the registration is stored right after this returns)

    def _refuse(op: str, a, b):
        # no redispatch to the kernel below ours exists for the same key; the dtypes left out here are ones a
        # model never feeds a dense GEMM (integers, complex, mixed), and torch refuses mixed ones itself
        raise RuntimeError(f"--batch-invariant: aten::{op} of {a.dtype} {tuple(a.shape)} @ {b.dtype} "
                           f"{tuple(b.shape)} is not covered by the batch-invariant GEMM")

    def mm(a, b):
        if not bi_matmul.supports(a, b) or a.dim() != 2:
            _refuse("mm", a, b)
        reg_calls().calls["mm"] += 1
        return bi_matmul.matmul(a, b)

    def bmm(a, b):
        if not bi_matmul.supports(a, b) or a.dim() != 3:
            _refuse("bmm", a, b)
        reg_calls().calls["bmm"] += 1
        return bi_matmul.matmul(a, b)

    def addmm(bias, a, b, *, beta=1, alpha=1):
        if not bi_matmul.supports(a, b) or a.dim() != 2:
            _refuse("addmm", a, b)
        reg_calls().calls["addmm"] += 1
        n = b.shape[-1]
        if beta == 1 and alpha == 1 and bias.dtype == a.dtype and bias.numel() == n and bias.shape[-1] == n:
            return bi_matmul.matmul(a, b, bias=bias)  # bias in fp32 before the one rounding (cuBLASLt's epilogue)
        out = bi_matmul.matmul(a, b)
        if alpha != 1:
            out.mul_(alpha)
        return out.add_(bias.expand_as(out), alpha=beta) if beta != 0 else out

    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("mm", mm, key)
        lib.impl("bmm", bmm, key)
        lib.impl("addmm", addmm, key)
    return lib
