"""Thin kopf handlers: every trigger becomes a reconcile request for one DwdpGroup; no decisions here.

  * index ``dwdp_pods``: (namespace, DwdpGroup name) -> slim pods carrying our labels;
  * any DwdpGroup event, any event of a pod we manage  -> reconcile that DwdpGroup;
  * startup: the reconciler lives in kopf's ``memo`` (``cli.py`` passes a ``kopf.Memo`` holding the
    ``Settings``; a restarted kopf gets a fresh memo, so nothing of a stopped kopf is reused).
    There is no resync loop here: the reconciler schedules its own wake-ups (event-driven, with a
    long jittered safety resync per object).
kopf's own state: the finalizer name and progress annotations get the ``dwdp.io`` prefix; no
diff base is kept (``NoDiffBase``). No handler kopf tracks to completion is registered (``on.event`` and ``index`` only), so
kopf adds no finalizer to a DwdpGroup and deletion is plain garbage collection of owned children.
"""

from __future__ import annotations

import logging

import kopf

from .. import labels as L
from ..observed import slim_pod
from ..reconciler import IO_THREADS, Reconciler, Settings, owner_key
from ..spec import GROUP, PLURAL, VERSION

POD_FILTER = {L.MANAGED_BY: L.MANAGER, L.COMPONENT: "worker"}
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
    memo.pods = PodIndexRef()
    memo.reconciler = Reconciler(settings=cfg, pods_of=memo.pods.pods_of)


class NoDiffBase(kopf.DiffBaseStorage):
    """No change detection. kopf builds a "diff base" of every event's body (a deep copy) for its
    on.create/on.update handlers; this operator registers only ``on.event`` and ``index`` handlers,
    which kopf calls whatever the diff, so the copy is pure cost: measured as a third of the
    operator's CPU while creating 600 pods (bench/operator_scale.py, cProfile)."""

    def build(self, *, body, extra_fields=None):
        return None

    def fetch(self, *, body):
        return None

    def store(self, *, body, patch, essence) -> None:
        return None


class PodIndexRef:
    """The kopf pod index, as handed to each handler call. kopf gives every object a shallow copy
    of the memo, so the index is kept in this shared holder, never assigned on a memo itself."""

    def __init__(self) -> None:
        self.index = None

    def pods_of(self, key):
        if self.index is None:
            return None  # kopf has not handed us the index yet: reconcile nothing blind
        if key not in self.index:
            return []
        return [dict(p) for p in self.index[key]]


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


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_):
    reconciler = memo.get("reconciler")
    if reconciler is not None:
        reconciler.close()


@kopf.index("pods", labels=POD_FILTER)
def dwdp_pods(namespace, labels, body, **_):
    key = owner_key(namespace, labels)
    return {key: slim_pod(body)} if key else {}


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_group(type, name, namespace, dwdp_pods, memo: kopf.Memo, **_):
    memo.pods.index = dwdp_pods
    if type == "DELETED":
        memo.reconciler.forget((namespace, name))
        return
    memo.reconciler.spawn((namespace, name))


@kopf.on.event("pods", labels=POD_FILTER)
async def on_pod(namespace, labels, dwdp_pods, memo: kopf.Memo, **_):
    memo.pods.index = dwdp_pods
    key = owner_key(namespace, labels)
    if key:
        memo.reconciler.spawn(key)
