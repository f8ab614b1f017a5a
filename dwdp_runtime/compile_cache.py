"""Kernel compile caches on one path that outlives the process: a second start compiles nothing.

``DWDP_COMPILE_CACHE_DIR=/path`` (``contract.TuningEnv.COMPILE_CACHE_DIR``; unset: each library's default under
``~/.cache``, which a pod loses on restart). ``apply(environ)`` — called by a rank process before it imports
torch or triton — points every JIT cache our kernels use below that path, unless the variable of that cache is
already set (an explicit setting wins):

  ======================  ==================  =====================================================
  cache                   variable            what it keeps
  ======================  ==================  =====================================================
  ``triton/``             ``TRITON_CACHE_DIR``  compiled Triton kernels (experts GEMMs, router, norms,
                                              RoPE, the batch-invariant matmul), keyed by source,
                                              constexprs, device and Triton version
  ``inductor/``           ``TORCHINDUCTOR_CACHE_DIR``  torch.compile artefacts (none in the default path)
  ``cutlass/``            ``CUTE_DSL_CACHE_DIR``  CuTe DSL kernels (FP8 experts, sm_gather)
  ======================  ==================  =====================================================

In Kubernetes the path is a volume (an ``emptyDir`` survives container restarts in the pod; a PVC or a
``hostPath`` survives pod replacement), added to the worker pods with ``spec.template`` and named by the
variable in the template's env — docs/OPERATOR.md. An image can be pre-warmed by one start at build time
with the variable pointing into the image (``bench/cold_start.py --cache-dir``).

Autotuning is not cached here: our tuner only runs when asked (``tune_experts``), forwards read the built-in
table (docs/KERNELS.md), so a start never autotunes. Pure stdlib: imported before torch.

A start that compiles nothing still pays the cache's lookup at its first kernel: Triton keys every entry by
``triton_key()``, a hash of its own sources and ``libtriton`` computed once per process (0.41 s of a 1.07 s
warm-up on an H100 host, 2026-12-07, ``bench/start_phases.py``), and its first compile imports Gluon (0.19 s).
``prewarm_in_background()`` does both on a daemon thread while the rank reads its weights: ``hashlib`` releases
the GIL on large buffers, so the hash runs beside the load instead of in the warm-up. A CUDA rank calls it;
anything missing (another Triton, no Triton) is skipped.
"""

from __future__ import annotations

import importlib
import logging
import os
import pathlib
import threading
from dataclasses import dataclass
from typing import MutableMapping

from .contract import TuningEnv

#: (module, function) of Triton's process-wide cache-key hash, newest location first (3.3+; 3.0–3.2)
TRITON_KEY_FUNCTIONS = (("triton.runtime.cache", "triton_key"), ("triton.compiler.compiler", "triton_key"))
#: modules Triton's first compile imports (3.6: Gluon's front end, on the compile path of every kernel)
TRITON_FIRST_COMPILE_IMPORTS = ("triton.experimental.gluon",)

log = logging.getLogger(__name__)

#: sub-directory → the library's own cache variable
CACHES: dict[str, str] = {"triton": "TRITON_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR",
                          "cutlass": "CUTE_DSL_CACHE_DIR"}


@dataclass(frozen=True)
class CompileCache:
    """Where each cache lives for this process (``None`` root: the variable is unset, library defaults)."""
    root: pathlib.Path | None
    dirs: dict[str, str]             # variable -> directory in effect (ours or the one already set)

    def entries(self) -> int:
        """Files under the caches in effect (a start that compiled nothing leaves this number unchanged)."""
        return sum(count_files(d) for d in self.dirs.values())


def count_files(path: str | os.PathLike) -> int:
    p = pathlib.Path(path)
    if not p.is_dir():
        return 0
    return sum(1 for _, _, files in os.walk(p) for _ in files)


def apply(environ: MutableMapping[str, str] | None = None) -> CompileCache:
    """Point the compile caches below ``DWDP_COMPILE_CACHE_DIR`` (module docstring); creates the directories.

    A cache directory that cannot be created (a read-only or foreign-owned volume, a path through a file) is a
    warning, never a failed start: that cache keeps its library default (the variable is left unset)."""
    env = os.environ if environ is None else environ
    raw = env.get(TuningEnv.COMPILE_CACHE_DIR.value, "")
    if not raw:
        return CompileCache(None, {var: env[var] for var in CACHES.values() if env.get(var)})
    root = pathlib.Path(raw).expanduser()
    dirs = {}
    for sub, var in CACHES.items():
        ours = not env.get(var)
        path = str(root / sub) if ours else env[var]
        try:
            pathlib.Path(path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            log.warning("%s=%s: cannot create the %s cache directory %s (%s); that cache stays at its library "
                        "default, so kernels may compile again at the next start", TuningEnv.COMPILE_CACHE_DIR.value,
                        raw, sub, path, exc)
            continue
        if ours:
            env[var] = path
        dirs[var] = path
    return CompileCache(root, dirs)


def _prewarm_triton() -> None:
    for module, name in TRITON_KEY_FUNCTIONS:
        try:
            getattr(importlib.import_module(module), name)()
            break
        except (ImportError, AttributeError):
            continue
    for module in TRITON_FIRST_COMPILE_IMPORTS:
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def prewarm_in_background() -> threading.Thread:
    """Compute Triton's cache key and its first compile's imports on a daemon thread (module docstring)."""
    thread = threading.Thread(target=_prewarm_triton, name="dwdp-triton-prewarm", daemon=True)
    thread.start()
    return thread
