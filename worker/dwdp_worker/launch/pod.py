"""``dwdp-worker pod``: the container entrypoint the operator runs (``docs/ENV_CONTRACT.md``).

1. parse the environment (``envcontract.parse_env``; a bad or missing variable → exit 2 naming it);
2. the model: ``DWDP_MODEL``, or a seeded synthetic ``DWDP_MODEL_SYNTHETIC`` checkpoint written to a
   temp dir (identical on every pod: same arch, seed 0, ``DWDP_NUM_EXPERTS`` experts, ``DWDP_DTYPE``);
   the checkpoint's expert count must equal ``DWDP_NUM_EXPERTS``;
3. one rank process per local GPU: local index i → DWDP rank ``DWDP_RANK_BASE + i`` on ``cuda:i``
   (``gpu_map.rank_devices``: every rank sees every GPU of the pod); without a GPU (CI) the host
   backend on CPU;
4. serve the pod port (``DWDP_HTTP_PORT``) with the same front as the local launcher; the pod exits
   non-zero when any rank dies, 0 after a SIGTERM drain.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib

from ..rank import timeouts
from .envcontract import EnvContractError, parse_env, serving_overrides
from .gpu_map import rank_devices
from .group import FrontPlan, add_serving_arguments, check_batch_invariant, check_cuda_graphs, cuda_count, run_front, synthetic_checkpoint
from dwdp_runtime.contract import ServingEnv
from dwdp_runtime.serving_options import ELASTIC_GRAPHS_REASON

from ..rank.prefill_graphs import rank_cuda_graphs
from ..rank.protocol import RankSpec


def add_pod_arguments(p: argparse.ArgumentParser) -> None:
    add_serving_arguments(p, default_port=0, default_rendezvous_s=timeouts.RENDEZVOUS_POD_S)
    p.set_defaults(host="0.0.0.0")


def build_pod_specs(env, model_dir: str, *, rendezvous_timeout_s: float, cuda_graphs: int | None = None,
                    batch_invariant: bool = False) -> list[RankSpec]:
    gpus = 0 if env.backend == "host" else cuda_count()
    devices = rank_devices(gpus_per_pod=env.gpus_per_pod, visible_gpus=gpus, backend=env.backend)
    check_cuda_graphs(cuda_graphs, gpus)
    check_batch_invariant(batch_invariant, gpus, cuda_graphs)
    config = env.dwdp_config()
    if config.elastic and cuda_graphs:
        raise EnvContractError(f"{ServingEnv.CUDA_GRAPHS.value}={cuda_graphs} in an elastic group (experts.replicas "
                               f"{config.expert_replicas}): {ELASTIC_GRAPHS_REASON}; leave spec.serving.cudaGraphs "
                               f"unset or 0")
    threads = 1 if gpus else max(1, (os.cpu_count() or 1) // env.gpus_per_pod)
    return [RankSpec(model_dir=model_dir, config=config.to_dict(), rank=env.rank_base + i,
                     group=env.group, global_id=i, store_host=env.store_addr, store_port=env.store_port,
                     job=f"{env.namespace}/{env.job}", attempt=env.attempt, token=env.token,
                     backend=env.backend if devices[i] else "host", device=devices[i],
                     dtype=env.dtype, threads=threads, rendezvous_timeout_s=rendezvous_timeout_s,
                     cuda_graphs=rank_cuda_graphs(cuda_graphs, gpu=devices[i] is not None, elastic=config.elastic,
                                                  batch_invariant=batch_invariant) if devices[i] else 0,
                     batch_invariant=batch_invariant,
                     pod_addr_template=env.pod_addr_template, gpus_per_pod=env.gpus_per_pod)
            for i in range(env.gpus_per_pod)]


def plan_pod(args: argparse.Namespace, environ, stack: contextlib.ExitStack) -> FrontPlan:
    env = parse_env(environ)
    for dest, value in serving_overrides(environ).items():  # spec.serving, when the operator set it
        setattr(args, dest, value)
    if env.model_synthetic:
        model_dir = synthetic_checkpoint(stack, env.model_synthetic, num_experts=env.num_experts, dtype=env.dtype)
    else:
        model_dir = env.model
        if not (pathlib.Path(model_dir) / "config.json").exists():
            raise EnvContractError(f"DWDP_MODEL={model_dir!r}: no config.json there (mount the checkpoint)")
    from ..rank.engine import num_experts_of

    n = num_experts_of(model_dir)
    if n != env.num_experts:
        raise EnvContractError(f"DWDP_NUM_EXPERTS={env.num_experts} but the checkpoint {model_dir} has {n} "
                               f"routed experts per layer: set experts.numExperts to {n} in the DwdpGroup")
    specs = build_pod_specs(env, model_dir, rendezvous_timeout_s=args.rendezvous_timeout_s,
                            cuda_graphs=args.cuda_graphs, batch_invariant=args.batch_invariant)
    kv = _kv_settings(args, environ)
    return FrontPlan(specs=specs, model_dir=model_dir, kv=kv, kv_advertise_host=_kv_host(args, environ, kv),
                     model_name=env.model_synthetic or pathlib.Path(model_dir).resolve().name,
                     port=args.port or env.http_port, group_attempt=env.attempt,
                     banner=(f"{env.job} group {env.group} attempt {env.attempt} pod {env.pod_index}: ranks "
                             f"{env.ranks} of {env.dwdp_size} ({specs[0].backend} backend), store "
                             f"{env.store_addr}:{env.store_port}"))


def _kv_settings(args: argparse.Namespace, environ):
    """The pod's contract.KvEnv (the operator's spec.kvTransfer) when present, else the --kv-* flags."""
    from dwdp_runtime.contract import KvEnv

    from ..kv.options import settings_from_args, settings_from_env

    if any(v.value in environ for v in KvEnv):
        try:
            return settings_from_env(environ)
        except ValueError as exc:
            raise EnvContractError(str(exc)) from None
    return settings_from_args(args)


def _kv_host(args: argparse.Namespace, environ, kv) -> str | None:
    """remote_host of the KV responses: --kv-advertise-host / DWDP_KV_ADVERTISE_HOST, else the pod IP."""
    from ..kv.options import advertise_host_for

    if not kv.enabled:
        return None
    try:
        return advertise_host_for(args, environ)
    except ValueError as exc:
        raise EnvContractError(str(exc)) from None


def run_pod(args: argparse.Namespace, environ=None) -> int:
    environ = os.environ if environ is None else environ
    return run_front("dwdp-worker pod", args, lambda stack: plan_pod(args, environ, stack))
