"""``dwdp-operator``: run the DwdpGroup operator (kopf, standalone: one replica, Recreate).

Exit codes: 0 on a clean stop, 1 on a startup error (message on stderr, no traceback), 2 on usage.

A transient API error that stops kopf (a kube-apiserver restarting answers 404 for custom resources
until its CRD handlers are synced, and kopf's watcher treats that 404 as fatal; found by
tests/k8s/test_k8s_faults.py) restarts kopf in-process after a delay doubling from ``RESTART_DELAY_S``
up to ``RESTART_DELAY_CAP_S`` (``restart_delay``), at most ``MAX_RESTARTS`` times within
``RESTART_WINDOW_S``: state is rebuilt from the API server (level-triggered), so this is the same as a
pod restart without the CrashLoopBackOff delay. The delays add up to ~2 minutes of tolerated outage: a
fixed 1 s × 5 gave up after ~5 s, shorter than the 404 window of a restarted API server on a loaded
2-core machine. That restart needs ``kopf.run`` to return: ``kopf_fixes`` mends the kopf defect that
could hang its stop. Every start of kopf waits until discovery lists DwdpGroups (``served``): a kopf started
while a restarted server's discovery still lags would watch nothing, silently.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

TRANSIENT_STATUS = {404, 429, 500, 502, 503, 504}
#: the first restart's delay: the API server's CRD handlers usually sync within a second or two
RESTART_DELAY_S = 1.0
#: the longest delay between two restarts: an outage longer than this is seen within this many seconds of its end
RESTART_DELAY_CAP_S = 30.0
#: restarts within RESTART_WINDOW_S before the operator exits 1 (and its pod's restart policy takes over):
#: delays 1 + 2 + 4 + 8 + 16 + 30 + 30 + 30 s = ~2 minutes of outage tolerated in-process
MAX_RESTARTS = 8
RESTART_WINDOW_S = 300.0
log = logging.getLogger("dwdp_operator.cli")


def _transient(e: BaseException) -> bool:
    if getattr(e, "status", None) in TRANSIENT_STATUS:
        return True
    try:
        import aiohttp
        return isinstance(e, (aiohttp.ClientConnectionError, ConnectionError, TimeoutError))
    except ImportError:
        return isinstance(e, (ConnectionError, TimeoutError))


def restart_delay(restarts: int) -> float:
    """Seconds before the ``restarts``-th restart within the window (1-based): doubling, capped."""
    return min(RESTART_DELAY_S * 2 ** max(restarts - 1, 0), RESTART_DELAY_CAP_S)


def is_pattern(namespace: str) -> bool:
    """A kopf namespace pattern (glob, negation, list) rather than one exact name."""
    return any(c in namespace for c in "*?[]!,")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dwdp-operator", description="Run the DwdpGroup operator.")
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch this namespace (repeatable; globs like 'team-*' work); default: all")
    p.add_argument("--resync-seconds", type=float, default=300.0,
                   help="safety resync of every DwdpGroup, jittered +-20%% (default 300); reconciles are "
                        "event-driven, this only catches what a missed event would leave behind")
    p.add_argument("--drain-seconds", type=float, default=5.0,
                   help="how long a scaled-away group stays out of the client Service before deletion")
    p.add_argument("--health-interval", type=float, default=10.0,
                   help="min seconds between two /healthz reads of one pod (default 10)")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0 = off)")
    p.add_argument("--liveness", default=None,
                   help="kopf liveness endpoint, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (kopf and the operator)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("kopf.objects", "kopf.activities.probe", "kopf._core.engines.peering"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        import kopf

        from . import handlers  # noqa: F401 — registers the kopf handlers
        from .handlers import kube_client
        from .reconciler import Settings
        from .refusals import describe
        from .served import wait_until_served
    except ImportError as e:
        print(f"dwdp-operator: missing dependency ({e}); install with: pip install 'dwdp-k8s[operator]'",
              file=sys.stderr)
        return 1
    from .gc_tuning import tune_gc
    from .kopf_fixes import install as fix_kopf_stream_stopper
    tune_gc()
    fix_kopf_stream_stopper()  # else a stop during an API server restart can hang kopf.run (kopf_fixes)
    settings = Settings(resync_seconds=args.resync_seconds, drain_seconds=args.drain_seconds,
                        health_interval=args.health_interval, namespaces=tuple(args.namespace),
                        literal_namespaces=bool(args.namespace) and not any(map(is_pattern, args.namespace)))
    if args.metrics_port:
        from prometheus_client import start_http_server
        start_http_server(args.metrics_port)
    restarts: list[float] = []
    while True:
        try:
            # kopf discovers DwdpGroups once per start: never start it blind (served.py says why)
            wait_until_served(kube_client())
            kopf.run(standalone=True, clusterwide=not args.namespace, namespaces=args.namespace,
                     liveness_endpoint=args.liveness, memo=kopf.Memo(settings=settings))
        except KeyboardInterrupt:
            return 0
        except Exception as e:  # noqa: BLE001 — a message, never a traceback, for the user
            now = time.monotonic()
            restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
            if _transient(e) and len(restarts) < MAX_RESTARTS:
                restarts.append(now)
                delay = restart_delay(len(restarts))
                log.warning("kopf stopped on a transient API error (%s); restarting it in %.0fs (%d/%d)",
                            describe(e), delay, len(restarts), MAX_RESTARTS)
                time.sleep(delay)  # a fresh memo: nothing from the stopped kopf (its pod index) is reused
                continue
            print(f"dwdp-operator: {describe(e)}", file=sys.stderr)
            return 1
        return 0


if __name__ == "__main__":
    sys.exit(main())
