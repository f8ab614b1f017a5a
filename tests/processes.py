"""The processes a test starts to play ranks, decode engines and KV servers (``run_group`` and the fault tests).

They are forked from one fork server per test process that imported torch and `transformers`' model machinery once
(seconds of CPU per process otherwise: on the 2-core CI machine, a large share of the whole suite), as the worker's
front starts its ranks (``dwdp_worker.front.rank_handle.rank_context``). A forked process does not inherit the
environment its parent has when it starts it, but the fork server's; ``process`` hands it the parent's current
environment (a test's ``monkeypatch.setenv`` reaches its ranks, as it would with ``spawn``). Queues, events, pipes
and barriers shared with these processes come from ``context()`` too (of the same method).

A process that measures its own memory growth starts in a fresh interpreter instead (``method=SPAWN``): a forked one
faults in the fork server's file-backed pages (libtorch's code) as it first runs them, and its RSS counts that as
growth (seen: a rank's peak growth 24.4 MiB where the spawned one measured the weights alone).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from typing import Any, Callable

#: imported once by the fork server, inherited by every process forked from it (none creates a CUDA context)
PRELOAD = ("torch", "transformers.modeling_utils", "dwdp_runtime.manager", "tests.runtime.workloads")
#: the start methods: forked from the preloaded fork server (the default), or a fresh interpreter
FORKSERVER, SPAWN = "forkserver", "spawn"


def context(method: str = FORKSERVER):
    """The tests' multiprocessing context: the fork server with ``PRELOAD`` imported, or ``spawn``."""
    ctx = mp.get_context(method)
    if method == FORKSERVER:
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _with_environ(environ: dict[str, str], target: Callable, args: tuple, kwargs: dict) -> Any:
    os.environ.clear()
    os.environ.update(environ)
    return target(*args, **kwargs)


def process(target: Callable, args: tuple = (), kwargs: dict | None = None, *, daemon: bool = True,
            name: str | None = None, method: str = FORKSERVER):
    """A process of ``context(method)`` that runs ``target(*args, **kwargs)`` in the caller's current environment."""
    return context(method).Process(target=_with_environ, args=(dict(os.environ), target, tuple(args), dict(kwargs or {})),
                             daemon=daemon, name=name)
