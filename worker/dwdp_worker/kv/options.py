"""KV handoff settings from flags (``--kv-*``) and from the pod environment (``DWDP_KV_*``).

Sizes accept plain bytes or units (``512MiB``, ``2GiB``, ``1.5GB``: pydantic's ``ByteSize``); the budget
is per rank (each rank registers its own region). Budget 0 (the default) turns the KV handoff off:
requests asking ``do_remote_decode`` are refused with a clear error and no NIXL agent starts.

``advertise_host_for`` picks the ``remote_host`` of the KV responses (``kv.address``) from the flag, the
environment (``DWDP_KV_ADVERTISE_HOST``, ``DWDP_POD_IP``) and the bound address; the launchers call it
before any rank starts, so a server that could only advertise a wildcard never starts.
"""

from __future__ import annotations

import argparse
from typing import Mapping

from pydantic import ByteSize, TypeAdapter, ValidationError

from .region import DEFAULT_BLOCK_BYTES
from .service import KvSettings
from .store import DEFAULT_GRACE_S, DEFAULT_LEASE_S, DEFAULT_TTL_S

_BYTES = TypeAdapter(ByteSize)


def parse_bytes(text: str | int) -> int:
    try:
        n = int(_BYTES.validate_python(text))
    except ValidationError:
        raise ValueError(f"{text!r} is not a size (bytes, or with a unit: 512MiB, 2GiB)") from None
    if n < 0:
        raise ValueError(f"{text!r}: a size must be >= 0")
    return n


def _arg_bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_kv_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("KV handoff (disaggregated serving, docs/KV_TRANSFER.md)")
    g.add_argument("--kv-budget-bytes", type=_arg_bytes, default=0,
                   help="KV region per rank for requests with kv_transfer_params.do_remote_decode "
                        "(e.g. 8GiB; GPU memory on CUDA ranks). 0 = off (default)")
    g.add_argument("--kv-block-bytes", type=_arg_bytes, default=DEFAULT_BLOCK_BYTES,
                   help=f"KV allocation unit (default {DEFAULT_BLOCK_BYTES >> 20} MiB, a multiple of 64)")
    g.add_argument("--kv-ttl-s", type=float, default=DEFAULT_TTL_S,
                   help=f"seconds unclaimed KV is kept before it is freed (default {DEFAULT_TTL_S:g})")
    g.add_argument("--kv-lease-s", type=float, default=DEFAULT_LEASE_S,
                   help=f"seconds a claimed pull may take before its KV is freed (default {DEFAULT_LEASE_S:g}); "
                        "a pull confirmed later is answered 'stale', never handed reused blocks")
    g.add_argument("--kv-grace-s", type=float, default=DEFAULT_GRACE_S,
                   help=f"seconds blocks freed by a lapsed lease (or an abort) wait before another sequence may "
                        f"use them, so a READ still in flight reads its own request's bytes (default "
                        f"{DEFAULT_GRACE_S:g})")
    g.add_argument("--kv-advertise-host", default=None, metavar="HOST",
                   help="remote_host of KV responses, the address decode engines reach this server at (env "
                        "DWDP_KV_ADVERTISE_HOST). Default: the --host address; for a wildcard --host the pod IP "
                        "(DWDP_POD_IP) in a pod, else this host's outgoing address")


def settings_from_args(args: argparse.Namespace) -> KvSettings:
    return check(KvSettings(budget_bytes=args.kv_budget_bytes, block_bytes=args.kv_block_bytes, ttl_s=args.kv_ttl_s,
                            lease_s=args.kv_lease_s, grace_s=args.kv_grace_s))


def advertise_host_for(args: argparse.Namespace, environ: Mapping[str, str]) -> str:
    """``remote_host`` of this server's KV responses (``kv.address.advertise_host``; ``AdvertiseError``, a
    ``ValueError``, when there is none to give)."""
    from dwdp_runtime.contract import KvEnv, TuningEnv

    from .address import advertise_host

    explicit = args.kv_advertise_host or environ.get(TuningEnv.KV_ADVERTISE_HOST) or None
    return advertise_host(explicit=explicit, pod_ip=environ.get(KvEnv.POD_IP) or None, bind_host=args.host)


def settings_from_env(env: Mapping[str, str]) -> KvSettings:
    """From the pod env (``contract.KvEnv``; the operator sets them from ``spec.kvTransfer``); absent = defaults."""
    from dwdp_runtime.contract import KvEnv

    def get(name, conv, default):
        raw = env.get(name, "")
        try:
            return conv(raw) if raw != "" else default
        except ValueError as exc:
            raise ValueError(f"{name}={raw!r}: {exc}") from None

    try:
        return check(KvSettings(budget_bytes=get(KvEnv.BUDGET_BYTES, parse_bytes, 0),
                                block_bytes=get(KvEnv.BLOCK_BYTES, parse_bytes, DEFAULT_BLOCK_BYTES),
                                ttl_s=get(KvEnv.TTL_S, float, DEFAULT_TTL_S),
                                lease_s=get(KvEnv.LEASE_S, float, DEFAULT_LEASE_S)))
    except ValueError as exc:
        raise ValueError(f"KV handoff env ({', '.join(KvEnv)}): {exc}") from None


def check(s: KvSettings) -> KvSettings:
    if s.block_bytes <= 0 or s.block_bytes % 64:
        raise ValueError(f"KV block size must be a positive multiple of 64 bytes (got {s.block_bytes})")
    if s.enabled and s.budget_bytes < s.block_bytes:
        raise ValueError(f"KV budget {s.budget_bytes} B is smaller than one block ({s.block_bytes} B)")
    if s.ttl_s <= 0 or s.lease_s <= 0:
        raise ValueError(f"KV TTL and lease must be > 0 s (got {s.ttl_s}, {s.lease_s})")
    if s.grace_s < 0:
        raise ValueError(f"KV grace period must be >= 0 s (got {s.grace_s})")
    return s
