"""The reconcile loop: coalesce triggers per DwdpGroup, read, plan (pure), apply (idempotent).

Invariants:
  1. At most one reconcile per DwdpGroup runs at a time (single event loop + per-key flag);
     triggers that arrive meanwhile coalesce into exactly one more pass, so a burst of 32 pod
     events costs one or two reconciles, not 32.
  2. Every pass starts from a fresh GET of the DwdpGroup and the kopf index of its pods; nothing
     else is remembered between passes except the health cache and apply's create memory (both
     only save API calls, neither changes a decision after ``REMEMBER_S``).
  3. A failed pass is logged and retried after ``retry_seconds``; it never kills the operator.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import labels as L
from . import metrics
from .apply import Applier
from .desired import desired_state
from .health import HealthReader

log = logging.getLogger("dwdp_operator.reconcile")
Key = tuple[str, str]  # (namespace, name)


@dataclass
class Settings:
    resync_seconds: float = 5.0
    drain_seconds: float = 5.0
    health_interval: float = 10.0
    retry_seconds: float = 2.0


@dataclass
class _KeyState:
    running: bool = False
    dirty: bool = False
    retry: asyncio.Handle | None = None


@dataclass
class Reconciler:
    settings: Settings = field(default_factory=Settings)
    applier: Applier | None = None
    health: HealthReader | None = None
    pods_of: Callable[[Key], list[dict] | None] = lambda key: None
    keys: set[Key] = field(default_factory=set)
    _state: dict[Key, _KeyState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.applier = self.applier or Applier()
        self.health = self.health or HealthReader(min_interval=self.settings.health_interval)

    async def request(self, key: Key) -> None:
        self.keys.add(key)
        st = self._state.setdefault(key, _KeyState())
        st.dirty = True
        if st.running:
            return
        st.running = True
        try:
            while st.dirty:
                st.dirty = False
                try:
                    await self._once(key)
                except Exception as e:  # noqa: BLE001 — invariant 3
                    metrics.RECONCILES.labels("error").inc()
                    log.warning("reconcile %s/%s failed (%s: %s); retrying in %.0fs", *key,
                                type(e).__name__, e, self.settings.retry_seconds)
                    if st.retry is None or st.retry.cancelled():
                        st.retry = asyncio.get_running_loop().call_later(
                            self.settings.retry_seconds, self._retry, key)
        finally:
            st.running = False

    def _retry(self, key: Key) -> None:
        st = self._state.get(key)
        if st is not None:
            st.retry = None
            asyncio.ensure_future(self.request(key))

    def forget(self, key: Key) -> None:
        self.keys.discard(key)
        self._state.pop(key, None)

    async def _once(self, key: Key) -> None:
        ns, name = key
        t0 = time.perf_counter()
        if self.pods_of(key) is None:
            return  # the pod index is not ready yet; its first event triggers us again
        cr = await asyncio.to_thread(self.applier.get_group, ns, name)
        if cr is None:
            self.forget(key)
            return
        if (cr.get("metadata") or {}).get("deletionTimestamp"):
            return  # garbage collection removes the children (owner references)
        pods = self.pods_of(key) or []
        port = int(((cr.get("spec") or {}).get("httpPort")) or 8000)
        health = await asyncio.to_thread(self.health.read_all, pods, port=port, namespace=ns)
        plan = desired_state(cr, pods, now=time.time(), token=secrets.token_urlsafe(32), health=health,
                             drain_seconds=self.settings.drain_seconds)
        counts = await asyncio.to_thread(self.applier.apply, cr, plan)
        for action in ("created", "deleted", "patched"):
            if counts[action]:
                metrics.CHILDREN.labels(action).inc(counts[action])
        for _, reason, _ in plan.events:
            metrics.EVENTS.labels(reason).inc()
        metrics.RECONCILES.labels("ok").inc()
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - t0)
        if any(counts.values()):
            log.info("reconciled %s/%s: %s", ns, name, counts)

    async def resync_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.resync_seconds)
            for key in list(self.keys):
                asyncio.ensure_future(self.request(key))


def owner_key(namespace: str | None, labels: dict[str, Any] | None) -> Key | None:
    owner = (labels or {}).get(L.NAME)
    return (namespace or "default", owner) if owner else None
