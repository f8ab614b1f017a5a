"""Thin kopf handlers: every trigger becomes ``Reconciler.request(key)``; no decisions here.

  * index ``dwdp_pods``: (namespace, DwdpGroup name) -> slim pods carrying our labels;
  * any DwdpGroup event, any event of a pod we manage  -> reconcile that DwdpGroup;
  * startup: build the reconciler and the resync loop (level-triggered safety net: backoff
    expiry, drains, health reads, anything a missed event would leave behind).
No finalizers and no kopf progress annotations: deletion is plain garbage collection.
"""

from __future__ import annotations

import asyncio
import logging

import kopf

from .. import labels as L
from ..observed import slim_pod
from ..reconciler import Reconciler, Settings, owner_key
from ..spec import GROUP, PLURAL, VERSION

SETTINGS = Settings()          # cli.py fills it from the command line before kopf starts
STATE: dict[str, object] = {}  # "reconciler", "index"
POD_FILTER = {L.MANAGED_BY: L.MANAGER, L.COMPONENT: "worker"}


def _reconciler() -> Reconciler:
    return STATE["reconciler"]  # type: ignore[return-value]


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_):
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.persistence.finalizer = "dwdp.io/kopf-finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="dwdp.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="dwdp.io")

    _load_kube_config()

    def pods_of(key):
        index = STATE.get("index")
        if index is None:
            return None  # kopf has not handed us the index yet: reconcile nothing blind
        if key not in index:
            return []
        return [dict(p) for p in index[key]]

    r = Reconciler(settings=SETTINGS, pods_of=pods_of)
    STATE["reconciler"] = r
    STATE["resync"] = asyncio.ensure_future(r.resync_forever())


def _load_kube_config() -> None:
    """The kubernetes client used by apply.py: in-cluster service account, else KUBECONFIG."""
    from kubernetes import config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


@kopf.on.cleanup()
async def cleanup(**_):
    task = STATE.pop("resync", None)
    if task is not None:
        task.cancel()


@kopf.index("pods", labels=POD_FILTER)
def dwdp_pods(namespace, labels, body, **_):
    key = owner_key(namespace, labels)
    return {key: slim_pod(body)} if key else {}


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_group(type, name, namespace, dwdp_pods, **_):
    STATE["index"] = dwdp_pods
    if type == "DELETED":
        _reconciler().forget((namespace, name))
        return
    await _reconciler().request((namespace, name))


@kopf.on.event("pods", labels=POD_FILTER)
async def on_pod(namespace, labels, dwdp_pods, **_):
    STATE["index"] = dwdp_pods
    key = owner_key(namespace, labels)
    if key:
        asyncio.ensure_future(_reconciler().request(key))
