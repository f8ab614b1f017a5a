"""Thin kopf handlers: every trigger becomes a reconcile request for one DwdpGroup; no decisions here.

  * any DwdpGroup event -> reconcile that DwdpGroup (kopf watches DwdpGroups only); the event's
    body is handed to the reconciler as its newest copy of the object;
  * the operator's pods come from ``pod_informer.PodInformer`` (a plain list+watch; any change of a
    pod we manage reconciles its DwdpGroup), not from kopf: kopf's per-event machinery cost grew
    with the number of objects;
  * startup: the reconciler lives in kopf's ``memo`` (``cli.py`` passes a ``kopf.Memo`` holding the
    ``Settings``; a restarted kopf gets a fresh memo, so nothing of a stopped kopf is reused).
    There is no resync loop here: the reconciler schedules its own wake-ups (event-driven, with a
    long jittered safety resync per object).
kopf's own state: the finalizer name and progress annotations get the ``dwdp.io`` prefix; no
diff base is kept (``NoDiffBase``). No handler kopf tracks to completion is registered (``on.event``
only), so kopf adds no finalizer to a DwdpGroup and deletion is plain garbage collection of owned
children.
"""

from __future__ import annotations

import asyncio
import logging

import kopf
from kubernetes import client

from ..pod_informer import PodInformer
from ..reconciler import IO_THREADS, Reconciler, Settings
from ..spec import GROUP, PLURAL, VERSION

WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; kopf re-lists and re-watches


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_):
    cfg: Settings = memo.get("settings") or Settings()
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = WATCH_TIMEOUT_S
    settings.persistence.finalizer = "dwdp.io/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="dwdp.io")
    settings.persistence.diffbase_storage = NoDiffBase()
    # exact namespace names: watch just those; no namespace or CRD discovery (RBAC: namespaced Roles)
    settings.scanning.disabled = cfg.literal_namespaces

    _load_kube_config()
    loop = asyncio.get_running_loop()
    holder: dict[str, object] = {}

    def on_change(key) -> None:  # on an informer thread
        if loop.is_closed():  # a stopped kopf (cli restarts it in-process): this informer is done too
            holder["informer"].stop()
            return
        loop.call_soon_threadsafe(holder["reconciler"].spawn, key)

    informer = PodInformer(client.ApiClient(), namespaces=list(cfg.namespaces) if cfg.literal_namespaces else None,
                           match=_namespace_matcher(cfg.namespaces), on_change=on_change)
    holder["informer"] = informer
    holder["reconciler"] = memo.reconciler = Reconciler(settings=cfg, pods_of=informer.pods_of)
    memo.informer = informer.start()


def _namespace_matcher(patterns: tuple[str, ...]):
    """kopf's namespace patterns (globs, negations, comma lists); every namespace when there are none."""
    if not patterns:
        return lambda ns: True
    from kopf._cogs.structs.references import match_namespace  # kopf's own semantics for -n

    return lambda ns: any(match_namespace(ns, p) for p in patterns)


class NoDiffBase(kopf.DiffBaseStorage):
    """No change detection. kopf builds a "diff base" of every event's body (a deep copy) for its
    on.create/on.update handlers; this operator registers only an ``on.event`` handler, which kopf
    calls whatever the diff, so the copy is pure cost: measured as a third of the
    operator's CPU while creating 600 pods (bench/operator_scale.py, cProfile)."""

    def build(self, *, body, extra_fields=None):
        return None

    def fetch(self, *, body):
        return None

    def store(self, *, body, patch, essence) -> None:
        return None


def _load_kube_config() -> None:
    """The kubernetes client used by apply.py: in-cluster service account, else KUBECONFIG; its
    connection pool as large as the reconciler's thread pool (urllib3 discards, and re-opens,
    every connection beyond the pool: TLS handshakes under load)."""
    from kubernetes import client, config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = max(cfg.connection_pool_maxsize or 0, IO_THREADS * 2)
    client.Configuration.set_default(cfg)


def kube_client() -> client.ApiClient:
    """A client on the operator's credentials (``_load_kube_config``), for work outside kopf."""
    _load_kube_config()
    return client.ApiClient()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_):
    for part in ("informer", "reconciler"):
        obj = memo.get(part)
        if obj is not None:
            obj.stop() if part == "informer" else obj.close()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_group(type, name, namespace, body, memo: kopf.Memo, **_):
    if type == "DELETED":
        memo.reconciler.forget((namespace, name))
        return
    memo.reconciler.observe((namespace, name), dict(body))  # the pass needs no GET (reconciler invariant 2)
    memo.reconciler.spawn((namespace, name))
