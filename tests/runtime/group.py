"""Run a function on N real processes that form one DWDP group over a real TCPStore.

Each rank runs ``fn(rank, world_size, port, **kw)`` in a process of its own (``tests.processes``: forked from a
fork server that imported torch once, in the test's environment); its return
value (picklable) or its exception text comes back through a queue. A rank may be told to die.

A program that runs many jobs in turn (one store per job) may ask for ``step_barrier``: it then gets ``step``, a
barrier of all started ranks, and waits on it before each job, so that one rank failing a job early cannot leave
the ranks a job apart (each later job then times out on one side while the other is still in the previous one).

The ranks import torch and the runtime, then meet at a start barrier before ``fn``: spawned interpreters
importing torch side by side on a loaded 2-core machine finish seconds apart, and a rendezvous timeout of a
few seconds (the timeout tests' own) would then name a slow *importer* as the missing rank.
"""

from __future__ import annotations

import traceback

from dwdp_runtime.ports import free_port, free_ports  # noqa: F401 - free_port: the tests' local ports
from tests.processes import FORKSERVER, SPAWN, context, process


def job_ports(jobs) -> dict:
    """One distinct free port per job (``dwdp_runtime.ports.free_ports``): job → port."""
    jobs = list(jobs)
    return dict(zip(jobs, free_ports(len(jobs))))


#: how long the ranks wait for each other at the start barrier (imports only; never the test's subject)
START_BARRIER_S = 120.0


def _entry(fn, rank, world, port, kw, q, start):
    try:
        import torch  # noqa: F401 - the slow part of a rank's start, done before the barrier

        import dwdp_runtime  # noqa: F401

        start.wait(START_BARRIER_S)
        q.put((rank, "ok", fn(rank, world, port, **kw)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_group(fn, world: int, *, harness_timeout_s: float = 120.0, ranks=None, step_barrier: bool = False,
              fresh_interpreters: bool = False, **kw) -> dict[int, tuple[str, object]]:
    """Start ranks (all by default), wait for them, return {rank: (status, value)}.

    A rank that exits without reporting (killed) shows as ``("died", exitcode)``; one still running at
    ``harness_timeout_s`` as ``("timeout", None)``. ``step_barrier``: ``fn`` gets ``step`` (module docstring).
    ``fresh_interpreters``: spawned instead of forked, for programs that measure their own memory (``tests.processes``).
    """
    method = SPAWN if fresh_interpreters else FORKSERVER
    ctx = context(method)
    q = ctx.Queue()
    port = kw.pop("port", None) or free_port()
    started = list(range(world) if ranks is None else ranks)
    start = ctx.Barrier(len(started))
    if step_barrier:
        kw["step"] = ctx.Barrier(len(started))
    procs = {r: process(_entry, (fn, r, world, port, kw, q, start), method=method) for r in started}
    for p in procs.values():
        p.start()
    results: dict[int, tuple[str, object]] = {}
    import queue as _q
    import time

    deadline = time.monotonic() + harness_timeout_s
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            rank, status, value = q.get(timeout=0.2)
            results[rank] = (status, value)
        except _q.Empty:
            for r, p in procs.items():
                if r not in results and not p.is_alive() and p.exitcode not in (None, 0):
                    results[r] = ("died", p.exitcode)
    for r, p in procs.items():
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
        results.setdefault(r, ("timeout", None))
    return results
