"""The local launcher (embedded default): G groups × D ranks as processes on this machine, one port.

``dwdp-worker --local --model DIR --groups G --dwdp-size D [--experts-per-worker K --prefetch-stride S]``

Invariants:
  * Each group has its own rendezvous store on loopback (a free port per group; rank 0 of the group
    hosts it) and its own random token: groups never see each other's keys.
  * Global rank id ``g*D + r``; device: ``--backend host`` → CPU; otherwise, with GPUs present,
    ``cuda:(id mod #GPUs)``; ``auto`` without GPUs → host backend.
  * K and S default to ``suggest_sharding(D, N)``; the config is validated (``DwdpConfig``) and the
    expert count checked against the checkpoint before any process starts.
  * CPU threads: without GPUs each rank gets ``max(1, cpus // (G*D))`` torch threads so ranks do not
    oversubscribe the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import secrets

from dwdp_runtime.config import DEFAULT_PREFETCH_SLOTS, TRANSFER_MODES, DwdpConfig, suggest_sharding
from dwdp_runtime import ports
from dwdp_runtime.contract import DEFAULT_ON_UNCOVERED, ON_UNCOVERED_POLICIES, Backend, ModelDtype, Transfer
from dwdp_runtime.serving_options import ELASTIC_GRAPHS_REASON

from ..rank import timeouts
from ..kv.options import advertise_host_for, settings_from_args
from .group import (FrontPlan, add_serving_arguments, check_batch_invariant, check_cuda_graphs, cuda_count, run_front,
                     synthetic_checkpoint)
from ..rank.prefill_graphs import rank_cuda_graphs
from ..rank.protocol import RankSpec


def add_local_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--local", action="store_true", required=True, help="run G×D ranks as local processes")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (config.json + safetensors)")
    src.add_argument("--synthetic", metavar="ARCH", help="write a seeded tiny model of ARCH to a temp dir and serve it")
    p.add_argument("--groups", type=int, default=1, help="G: independent DWDP groups (default 1)")
    p.add_argument("--dwdp-size", type=int, default=2, help="D: ranks per group (default 2)")
    p.add_argument("--experts-per-worker", type=int, default=None, help="K (default: the smallest that covers)")
    p.add_argument("--prefetch-stride", type=int, default=None, help="S (default: the smallest that covers)")
    p.add_argument("--prefetch-slots", type=int, default=DEFAULT_PREFETCH_SLOTS,
                   help=f"expert buffers per layer for prefetched weights (default {DEFAULT_PREFETCH_SLOTS}: double "
                        f"buffering)")
    p.add_argument("--expert-replicas", type=int, default=1,
                   help="r: store every expert on at least r ranks of a group (1..D; default 1 = no spare copy). "
                        "Costs up to (r-1)*K more experts of memory per rank")
    p.add_argument("--on-uncovered", choices=ON_UNCOVERED_POLICIES, default=DEFAULT_ON_UNCOVERED,
                   help="a rank loss that leaves an expert with no surviving holder (r=1, or r ranks lost): restart "
                        "the group (default: today's behaviour, no run-time read or memory) or reload: every "
                        "survivor reads only those experts from the checkpoint into more memory of its own and "
                        "serves on (makes even r=1 elastic; excludes --cuda-graphs; docs/RUNTIME.md)")
    p.add_argument("--contention-opt", action="store_true",
                   help="cut expert copies into 2 MiB slices interleaved across peers (spreads the pull over sources)")
    p.add_argument("--transfer", choices=TRANSFER_MODES, default=Transfer.COPY_ENGINE.value,
                   help="how experts move between ranks (default copy_engine; docs/RUNTIME.md)")
    p.add_argument("--backend", choices=[b.value for b in Backend], default=Backend.AUTO.value,
                   help="memory backend: cuda (GPUs), host (CPU shared memory), auto = cuda when a GPU is visible")
    p.add_argument("--dtype", choices=[d.value for d in ModelDtype], default=None,
                   help="default: the checkpoint's dtype")
    p.add_argument("--threads-per-rank", type=int, default=None, help="torch CPU threads per rank")
    add_serving_arguments(p, default_rendezvous_s=timeouts.RENDEZVOUS_LOCAL_S)


def build_local_specs(*, model_dir: str, groups: int, dwdp_size: int, experts_per_worker: int | None,
                      prefetch_stride: int | None, prefetch_slots: int = DEFAULT_PREFETCH_SLOTS,
                      contention_opt: bool = False,
                      expert_replicas: int = 1, on_uncovered: str = DEFAULT_ON_UNCOVERED,
                      transfer: str = Transfer.COPY_ENGINE.value, backend: str = Backend.AUTO.value, dtype: str | None = None,
                      threads_per_rank: int | None = None,
                      rendezvous_timeout_s: float = timeouts.RENDEZVOUS_LOCAL_S,
                      num_experts: int | None = None, cuda_graphs: int | None = None,
                      batch_invariant: bool = False) -> list[RankSpec]:
    """The G×D rank specs; raises ValueError with the fix on a bad shape."""
    if groups < 1:
        raise ValueError(f"--groups={groups}: must be >= 1")
    if num_experts is None:
        from ..rank.engine import num_experts_of

        num_experts = num_experts_of(model_dir)
    k0, s0 = suggest_sharding(dwdp_size=dwdp_size, num_experts=num_experts)
    config = DwdpConfig(dwdp_size=dwdp_size, num_experts=num_experts, num_groups=groups,
                        num_experts_per_worker=experts_per_worker or k0, num_prefetch_experts=prefetch_stride or s0,
                        num_prefetch_slots=prefetch_slots, contention_opt=contention_opt, transfer=transfer,
                        expert_replicas=expert_replicas, on_uncovered=on_uncovered)
    gpus = 0 if backend == "host" else cuda_count()
    if backend == "cuda" and gpus == 0:
        raise ValueError("--backend cuda: no CUDA GPU is visible (use --backend host or auto)")
    check_cuda_graphs(cuda_graphs, gpus)
    if config.elastic and cuda_graphs:
        raise ValueError(f"--expert-replicas {expert_replicas} / --on-uncovered {on_uncovered} (an elastic group) "
                         f"with --cuda-graphs {cuda_graphs}: {ELASTIC_GRAPHS_REASON}; set one of them off")
    check_batch_invariant(batch_invariant, gpus, cuda_graphs)
    n = groups * dwdp_size
    threads = threads_per_rank or (1 if gpus else max(1, (os.cpu_count() or 1) // n))
    # one store port per group, no two groups' apart (ports.free_port_blocks); an elastic group also needs every
    # rank's standby store port next to its store's (one host: a block of D + 1)
    try:
        store_ports = ports.free_port_blocks(groups, dwdp_size + 1 if config.elastic else 1)
    except ports.NoFreePorts as exc:
        raise ValueError(f"{exc}: free some local ports or run fewer groups") from None
    specs = []
    for g, port in enumerate(store_ports):
        token = secrets.token_hex(16)
        for r in range(dwdp_size):
            gid = g * dwdp_size + r
            specs.append(RankSpec(model_dir=str(model_dir), config=config.to_dict(), rank=r, group=g, global_id=gid,
                                  store_host="127.0.0.1", store_port=port, job="local", attempt=0, token=token,
                                  backend="host" if not gpus else backend, device=f"cuda:{gid % gpus}" if gpus else None,
                                  dtype=dtype, threads=threads, rendezvous_timeout_s=rendezvous_timeout_s,
                                  cuda_graphs=rank_cuda_graphs(cuda_graphs, gpu=bool(gpus), elastic=config.elastic,
                                                               batch_invariant=batch_invariant),
                                  batch_invariant=batch_invariant))
    return specs


def plan_local(args: argparse.Namespace, stack: contextlib.ExitStack) -> FrontPlan:
    model_dir = synthetic_checkpoint(stack, args.synthetic) if args.synthetic else args.model
    if not (pathlib.Path(model_dir) / "config.json").exists():
        raise ValueError(f"--model {model_dir}: no config.json there (a Hugging Face checkpoint directory)")
    specs = build_local_specs(model_dir=model_dir, groups=args.groups, dwdp_size=args.dwdp_size,
                              experts_per_worker=args.experts_per_worker, prefetch_stride=args.prefetch_stride,
                              prefetch_slots=args.prefetch_slots, contention_opt=args.contention_opt,
                              expert_replicas=args.expert_replicas, on_uncovered=args.on_uncovered,
                              transfer=args.transfer, backend=args.backend, dtype=args.dtype,
                              threads_per_rank=args.threads_per_rank, rendezvous_timeout_s=args.rendezvous_timeout_s,
                              cuda_graphs=args.cuda_graphs, batch_invariant=args.batch_invariant)
    name = args.synthetic or pathlib.Path(model_dir).resolve().name
    kv = settings_from_args(args)
    return FrontPlan(specs=specs, model_dir=model_dir, model_name=name, port=args.port, kv=kv,
                     kv_advertise_host=advertise_host_for(args, os.environ) if kv.enabled else None,
                     banner=f"serving {args.served_model_name or name} with {args.groups} group(s) × "
                            f"{args.dwdp_size} ranks ({specs[0].backend} backend)")


def run_local(args: argparse.Namespace) -> int:
    return run_front("dwdp-worker --local", args, lambda stack: plan_local(args, stack))
