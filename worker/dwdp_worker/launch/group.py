"""One launch flow for ``--local`` and ``pod``: options, a plan (which ranks, which model), then the front.

    plan = build(stack)     # launcher.plan_local / pod.plan_pod: validate, write a synthetic checkpoint
                            # into a temp dir owned by ``stack``; ValueError → exit 2 with the reason
    Supervisor(plan.specs, options)  →  serve()  →  exit code (0 drained, 1 failed, 2 bad input)

Invariants: a bad argument or environment is refused before any rank process starts (exit 2, one line,
no traceback); temporary checkpoints are removed however the front ends; every rank runs at the
front's log level, so load progress reaches the log at info.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

from pydantic import ValidationError

from dwdp_runtime.contract import DEFAULT_HTTP_PORT
from dwdp_runtime.serving_options import BATCH_INVARIANT_GRAPHS_REASON, ServingOptions

from ..rank import timeouts
from ..front.http_limits import MAX_BODY_BYTES, HttpBounds
from ..kv.options import add_kv_arguments
from ..kv.service import KvSettings
from ..rank.prefill_graphs import check_max_graphs
from ..rank.protocol import RankSpec


@dataclass(frozen=True)
class FrontPlan:
    specs: list[RankSpec]
    model_dir: str
    model_name: str
    port: int
    group_attempt: int = 0
    banner: str = ""
    kv: KvSettings = KvSettings()     # KV handoff of every rank (flags, or the pod's contract.KvEnv)
    kv_advertise_host: str | None = None  # remote_host of KV responses (kv.address; None with KV off)


def cuda_count() -> int:
    """GPUs this process may use (``CUDA_VISIBLE_DEVICES`` applies), 0 without a driver. Asked of the driver API
    (``cuda.bindings``: a few ms) rather than torch: the front never runs CUDA itself, and importing torch here
    put 3 s of an H100 host's start before the first rank was spawned (``bench/cold_start.py``, 2026-12-07)."""
    try:
        import cuda.bindings.driver as driver
    except Exception:  # noqa: BLE001 - no cuda-python: ask torch
        return _torch_cuda_count()
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return 0
        err, count = driver.cuDeviceGetCount()
        return int(count) if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception:  # noqa: BLE001 - a driver library that cannot be loaded: no GPU
        return 0


def _torch_cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def check_cuda_graphs(cuda_graphs: int | None, gpus: int) -> None:
    """``--cuda-graphs`` given: refused (ValueError, before any rank starts) when negative or without a GPU to use.
    Unset (``None``) is never refused: ``rank_cuda_graphs`` turns it into a count per rank."""
    if cuda_graphs is None:
        return
    check_max_graphs(cuda_graphs, "--cuda-graphs")
    if cuda_graphs and gpus == 0:
        raise ValueError(f"--cuda-graphs={cuda_graphs}: CUDA graphs need the ranks on GPUs, and these run on the "
                         f"host backend (no GPU visible, or --backend host); drop --cuda-graphs")


def check_batch_invariant(batch_invariant: bool, gpus: int, cuda_graphs: int | None = None) -> None:
    """``--batch-invariant``: refused (ValueError, before any rank starts) without a GPU — its GEMM is a Triton
    kernel, and a host rank has no device to run it on — and with ``--cuda-graphs``: its attention reads each
    forward's packed sequences on the host (``model.attention``), which a graph replay cannot."""
    if batch_invariant and gpus == 0:
        raise ValueError("--batch-invariant: the batch-invariant GEMMs are Triton kernels and need the ranks on "
                         "GPUs; these run on the host backend (no GPU visible, or --backend host); drop it")
    if batch_invariant and cuda_graphs:
        raise ValueError(f"--batch-invariant excludes --cuda-graphs={cuda_graphs}: {BATCH_INVARIANT_GRAPHS_REASON}; "
                         f"drop one")


def synthetic_checkpoint(stack: contextlib.ExitStack, arch: str, **kw) -> str:
    """A seeded synthetic checkpoint (with a tokenizer) in a temp dir removed when ``stack`` closes."""
    from ..checkpoint.synth import write_synthetic

    tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dwdp-synth-"))
    return str(write_synthetic(arch, pathlib.Path(tmp) / arch, seed=0, tokenizer=True, **kw))


def _argparse_literal(text: str) -> str:
    """``text`` as argparse help: argparse %-formats help strings, so a literal ``%`` is doubled."""
    return text.replace("%", "%%")


def add_serving_arguments(p: argparse.ArgumentParser, *, default_port: int = DEFAULT_HTTP_PORT,
                          default_rendezvous_s: float = timeouts.RENDEZVOUS_LOCAL_S) -> None:
    """Front options shared by ``--local`` and ``pod``."""
    g = p.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1; 0.0.0.0 in a pod)")
    g.add_argument("--port", type=int, default=default_port, help=f"HTTP port (default {default_port})")
    for field, info in ServingOptions.model_fields.items():  # the options spec.serving can set too
        is_int = ServingOptions.is_int(field)
        described = _argparse_literal(info.description)
        shown = info.default if info.default is not None else ("unset" if is_int else "none")
        if info.annotation is bool:  # --batch-invariant / --no-batch-invariant
            g.add_argument(ServingOptions.flag(field), action=argparse.BooleanOptionalAction, default=info.default,
                           help=f"{described} (default {'on' if info.default else 'off'})")
            continue
        g.add_argument(ServingOptions.flag(field), type=int if is_int else str, default=info.default,
                       metavar="N" if is_int else "NAME", help=f"{described} (default {shown})")
    g.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body; larger is a 413 (default {MAX_BODY_BYTES})")
    g.add_argument("--header-timeout-s", type=float, default=timeouts.HTTP_HEADER_TIMEOUT_S,
                   help=f"a request's headers must arrive within this, or 408 and close "
                        f"(default {timeouts.HTTP_HEADER_TIMEOUT_S:g})")
    g.add_argument("--body-timeout-s", type=float, default=timeouts.HTTP_BODY_TIMEOUT_S,
                   help=f"a request's body must arrive within this, or 408 (default {timeouts.HTTP_BODY_TIMEOUT_S:g})")
    g.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="wait this long for more requests before a partly filled forward (default 0)")
    g.add_argument("--heartbeat-timeout-s", type=float, default=timeouts.HEARTBEAT_TIMEOUT_S,
                   help=f"a ready rank silent this long is frozen: killed, the front fails "
                        f"(default {timeouts.HEARTBEAT_TIMEOUT_S:g})")
    g.add_argument("--forward-timeout-s", type=float, default=timeouts.FORWARD_TIMEOUT_S,
                   help="a rank busy in one forward longer than this is killed (the front then exits 1)")
    g.add_argument("--drain-timeout-s", type=float, default=timeouts.DRAIN_TIMEOUT_S,
                   help="SIGTERM: max wait for admitted requests")
    g.add_argument("--max-rank-respawns", type=int, default=timeouts.MAX_RANK_RESPAWNS, metavar="N",
                   help=f"an elastic group (--expert-replicas >= 2): restart a lost rank's process at most N times "
                        f"(it rejoins the running group); 0 = never, the group serves degraded "
                        f"(default {timeouts.MAX_RANK_RESPAWNS})")
    g.add_argument("--rendezvous-timeout-s", type=float, default=default_rendezvous_s,
                   help=f"wait this long for the group's other ranks (default {default_rendezvous_s:g})")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info shows each rank's load progress (default info)")
    add_kv_arguments(p)


def serving_options(args: argparse.Namespace) -> ServingOptions:
    """The ``ServingOptions`` of the parsed flags (``ValueError`` naming a flag out of its bounds)."""
    values = {f: getattr(args, f) for f in ServingOptions.model_fields}
    try:
        return ServingOptions(**values)
    except ValidationError as exc:
        bad = sorted({str(e["loc"][0]) for e in exc.errors()})
        raise ValueError("; ".join(f"{ServingOptions.flag(f)}={values[f]!r}: must be {ServingOptions.expected(f)}"
                                   for f in bad)) from None


def run_front(prog: str, args: argparse.Namespace, build: Callable[[contextlib.ExitStack], FrontPlan]) -> int:
    """Plan, then serve until drained or failed: the process exit code."""
    from ..front.rank_handle import rank_context
    from ..front.serve import serve
    from ..front.supervisor import Supervisor

    with contextlib.ExitStack() as stack:
        try:
            options = serving_options(args)  # bad flags are refused before a checkpoint is written
            plan = build(stack)
            if options.served_model_name is None:
                options = options.model_copy(update={"served_model_name": plan.model_name})
            if args.max_rank_respawns < 0:
                raise ValueError(f"--max-rank-respawns={args.max_rank_respawns}: must be >= 0 (0: never restart)")
            rank_context()  # DWDP_RANK_START: an unknown value is refused before any rank starts
        except ValueError as exc:  # EnvContractError, bad sharding, missing checkpoint, a bad DWDP_RANK_START
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 2
        specs = [dataclasses.replace(s, log_level=args.log_level.upper(), kv=plan.kv) for s in plan.specs]
        sup = Supervisor(specs, model_dir=plan.model_dir, options=options, group_attempt=plan.group_attempt,
                         batch_wait_s=args.batch_wait_ms / 1000.0, heartbeat_timeout_s=args.heartbeat_timeout_s,
                         forward_timeout_s=args.forward_timeout_s, drain_timeout_s=args.drain_timeout_s,
                         kv_advertise_host=plan.kv_advertise_host, max_rank_respawns=args.max_rank_respawns)
        kv = f", KV responses name {plan.kv_advertise_host}" if plan.kv_advertise_host else ""
        print(f"{prog}: {plan.banner}, http {args.host}:{plan.port}{kv}", file=sys.stderr, flush=True)
        bounds = HttpBounds(max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout_s,
                            body_timeout_s=args.body_timeout_s)
        return serve(sup, host=args.host, port=plan.port, log_level=args.log_level, bounds=bounds)
