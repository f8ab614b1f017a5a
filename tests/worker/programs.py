"""Rank programs for the worker tests (importable by spawned processes)."""

from __future__ import annotations

import contextlib
import os

# How long a rank waits at a rendezvous for the slowest peer. On a fresh 2-core CI machine four ranks import
# torch and load a checkpoint at once, and one can arrive more than a minute after rank 0 (CI failed at 60 s:
# 'transport/fd-servers', d = 4 FP8); it stays below the tests' 240 s harness limit so that a hung peer is
# still reported as a rendezvous timeout naming the step, not as a killed harness.
RENDEZVOUS_TIMEOUT_S = 180.0


def _rdzv(rank, world, port, job, timeout_s=RENDEZVOUS_TIMEOUT_S):
    from dwdp_runtime.rendezvous import StoreRendezvous

    return StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job=job, token="tok",
                           timeout_s=timeout_s)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """``os.environ`` with ``values`` set, restored on exit."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def oracle_program(rank, world, port, *, runs, batches, ports, threads=1, backend="host", gpus=0, cuda_graphs=None,
                   env=None):
    """For each (job, model_dir, k, s, dtype) in ``runs``: build an Engine, run every batch, return the logits.

    ``cuda_graphs``: job → the engine's ``cuda_graphs`` (absent: 0, eager). ``env``: job → variables set while
    that job's Engine is built (e.g. ``DWDP_FP8_DENSE``, read at load), restored after.

    One process serves several models in turn (import cost paid once); each run is its own rendezvous job
    on its own store port (``ports[job]``; rank 0's store of the previous run may still be shutting down).
    """
    import torch

    torch.set_num_threads(threads)
    from dwdp_runtime.config import DwdpConfig
    from dwdp_worker.rank.engine import Engine, num_experts_of
    from dwdp_worker.checkpoint.fp8_dense import kept_linears

    out = {}
    for job, model_dir, k, s, dtype in runs:
        cfg = DwdpConfig(dwdp_size=world, num_experts=num_experts_of(model_dir), num_experts_per_worker=k,
                         num_prefetch_experts=s)
        with _rdzv(rank, world, ports[job], job) as rdzv, _environ((env or {}).get(job, {})):
            device = f"cuda:{rank % gpus}" if gpus else None
            engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend=backend,
                                  device=device, token="tok", dtype=dtype, progress=False,
                                  cuda_graphs=(cuda_graphs or {}).get(job, 0))
            try:
                results = [engine.forward(b) for b in batches]
                out[job] = {"logits": [r.logits.numpy() for r in results], "restarts": [r.restarts for r in results],
                            "stats": engine.stats(), "local": engine.manager.local_range,
                            "fp8_linears": kept_linears(engine.model), "dense_bytes": engine.load_report.dense_bytes}
            finally:
                engine.close()
    return out


def _vm_hwm_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def _vm_rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _handle_bytes_by_role(manager) -> dict:
    """What the runtime really allocated: local handle bytes of scale / weight tensors, and the page pool."""
    from dwdp_worker.model.experts_layout import ParamRole

    by = {"scales": 0, "weights": 0}
    for e in manager.transport._entries:  # FP8 *_scale_inv, MXFP4 *_scales, NVFP4 *_weight_scale(_2)
        by["scales" if ParamRole.of(str(e.key[1])) is ParamRole.SCALE else "weights"] += e.alloc.nbytes
    by["pool"] = sum(a.nbytes for pages in manager.buffer._pool for a in pages)
    return by


def memory_program(rank, world, port, *, model_dir, k, s):
    """Peak RSS growth of Engine.build (dense + this rank's experts), measured with the kernel's high-water mark."""
    import gc

    import torch

    torch.set_num_threads(1)
    from dwdp_runtime.config import DwdpConfig
    from dwdp_worker.rank.engine import Engine, num_experts_of
    from dwdp_worker.checkpoint.loader import build_meta_model, load_config

    # import the modeling code (~130 MiB of interpreter/library state) and build transformers' conversion-rule
    # table (a process-wide cache of every architecture's rules, a few MiB) before measuring weights
    from dwdp_worker.checkpoint.names import conversion_rules

    conversion_rules(build_meta_model(load_config(model_dir), torch.float32))

    cfg = DwdpConfig(dwdp_size=world, num_experts=num_experts_of(model_dir), num_experts_per_worker=k,
                     num_prefetch_experts=s)
    with _rdzv(rank, world, port, "mem") as rdzv:
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:  # reset the peak-RSS high-water mark
            f.write("5")
        base = _vm_rss_kib()
        engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend="host",
                              token="tok", progress=False)
        peak = _vm_hwm_kib()
        report = engine.load_report
        result = {"peak_growth": (peak - base) * 1024, "local_expert_bytes": report.local_expert_bytes,
                  "total_expert_bytes": report.total_expert_bytes, "dense_bytes": report.dense_bytes,
                  "largest_local_weight": report.largest_local_weight,
                  "local_scale_bytes": report.local_scale_bytes, "mapped": report.mapped,
                  "handles": _handle_bytes_by_role(engine.manager), "pid": os.getpid()}
        engine.forward([[1, 2, 3]])
        engine.close()
    return result


def engine_api_program(rank, world, port, *, model_dir):
    """Exercise the Engine's contract on a real group: bad input, timings, stats, tokenizer, close."""
    import torch

    torch.set_num_threads(1)
    from dwdp_runtime.config import DwdpConfig
    from dwdp_worker.rank.engine import Engine, num_experts_of
    from dwdp_worker.model.packing import BadBatchError

    cfg = DwdpConfig.even(dwdp_size=world, num_experts=num_experts_of(model_dir))
    out = {"errors": []}
    with _rdzv(rank, world, port, "api") as rdzv:
        engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend="host",
                              token="tok", progress=(rank == 0))
        for bad in ([], [[]], [[1, 2, engine.vocab_size]], [[-1]], [["a"]], "text", [[1] * (engine.max_positions + 1)]):
            try:
                engine.forward(bad)
            except BadBatchError as exc:
                out["errors"].append(str(exc))
        r = engine.forward([[1, 2, 3], [4, 5]])
        out.update(shape=tuple(r.logits.shape), dtype=str(r.logits.dtype), compute_s=r.compute_s,
                   wait_s=r.prefetch_wait_s, restarts=r.restarts, vocab=engine.vocab_size,
                   max_positions=engine.max_positions)
        out["stats"] = engine.stats()
        engine.close()
        engine.close()  # idempotent
        try:
            engine.forward([[1]])
        except RuntimeError as exc:
            out["after_close"] = str(exc)
    return out


#: how long a matrix rank waits for its peers between runs: past one run's rendezvous timeout (30 s), so a run that
#: failed on one rank and timed out on the other still meets at the next step
MATRIX_STEP_S = 90.0


def matrix_program(rank, world, port, *, runs, batches, ports, step, rendezvous_timeout_s=30.0,
                   step_timeout_s=MATRIX_STEP_S):
    """``oracle_program`` for the support matrix: many model types in one process set, one failure per run
    recorded (``{"error": text}``) instead of ending the rank, so one architecture cannot hide the others.

    Every rank waits on ``step`` (``run_group(step_barrier=True)``) before each run: a run that fails early on one
    rank must not leave the ranks a run apart. A rank that does not come within ``step_timeout_s`` ends the
    program: that run and every later one are recorded as not started, naming the run a peer did not finish."""
    import threading

    import torch

    torch.set_num_threads(1)
    from dwdp_runtime.config import DwdpConfig
    from dwdp_worker.rank.engine import Engine, num_experts_of

    out = {}
    for i, (job, model_dir, k, s) in enumerate(runs):
        try:
            step.wait(step_timeout_s)
        except threading.BrokenBarrierError:
            previous = runs[i - 1][0] if i else "the start"
            for later, *_ in runs[i:]:
                out[later] = {"error": f"not started: a peer rank did not finish {previous} within "
                                       f"{step_timeout_s:g} s of rank {rank}"}
            return out
        try:
            cfg = DwdpConfig(dwdp_size=world, num_experts=num_experts_of(model_dir), num_experts_per_worker=k,
                             num_prefetch_experts=s)
            with _rdzv(rank, world, ports[job], job, timeout_s=rendezvous_timeout_s) as rdzv:
                engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend="host",
                                      token="tok", progress=False)
                try:
                    results = [engine.forward(b) for b in batches]
                    out[job] = {"logits": [r.logits.numpy() for r in results], "stats": engine.stats(),
                                "local": engine.manager.local_range}
                finally:
                    engine.close()
        except Exception as exc:  # noqa: BLE001 - reported per model type
            out[job] = {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    return out
