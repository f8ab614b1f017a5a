"""What the multi-process benchmarks share: start a group of rank processes and collect their results; wait for a
device's work before reading a clock.

Ranks are spawned (fresh interpreters), not forked: a benchmark rank creates its CUDA context itself, and a parent
that touched CUDA cannot fork one.
"""

from __future__ import annotations

import multiprocessing as mp
import sys

from dwdp_runtime.ports import free_port

#: how long the parent waits for the next result before it looks for a rank that died
RESULT_POLL_S = 5.0
#: how long each finished rank gets to exit
JOIN_S = 30.0


def sync_device(device) -> None:
    """Wait until ``device``'s queued work is done (a no-op on the CPU): the timings around it are then real."""
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def spawn_ranks(target, world: int, *target_args) -> dict | None:
    """Run ``target(rank, *target_args, port, queue)`` in ``world`` spawned processes; ``{rank: result}``, or
    None (errors printed) when a rank failed or died. The first failure ends the run at once: the other ranks
    would otherwise wait for the failed one at their last barrier until its timeout."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, *target_args, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < len(procs):
        try:
            rank, value = q.get(timeout=RESULT_POLL_S)
            results[rank] = value
            if "error" in value:
                for p in procs:
                    p.terminate()
                break
        except Exception:  # noqa: BLE001 - queue.Empty
            dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
            if dead:
                print(f"rank(s) {dead} died", file=sys.stderr)
                break
    for p in procs:
        p.join(timeout=JOIN_S)
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    if errors or 0 not in results:
        for r, e in sorted(errors.items()):
            print(f"rank {r} failed:\n{e}", file=sys.stderr)
        return None
    return results
