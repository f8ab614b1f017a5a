"""The reconcile loop: coalesce triggers per DwdpGroup, read, plan (pure), apply (idempotent).

Invariants:
  1. At most one reconcile per DwdpGroup runs at a time (single event loop + per-key flag);
     triggers that arrive meanwhile coalesce into exactly one more pass, so a burst of 32 pod
     events costs one or two reconciles, not 32.
  2. Every pass starts from the newest copy of the DwdpGroup the operator has (``_KeyState.body``:
     kopf's latest event or the answer to the operator's own last status write, whichever has the
     higher resourceVersion; a GET when there is none, and for every pass a timer starts — resync,
     backoff, retry — so the safety net never trusts a cache) and the pod informer's view of its
     pods. A pass waits for the informer to show the pods the previous pass created or rolled back
     (``expectations``, at most ``POD_REMEMBER_S``). Nothing else is remembered between passes
     except the health cache and apply's create memory (bounded, they only save API calls).
  3. Event-driven: a pass runs on a DwdpGroup or pod event, and otherwise only when the plan asks
     (``Plan.requeue_after``: a backoff or drain ending), when a running pod's health is due, or
     on the safety resync, ``resync_seconds`` jittered by ±``RESYNC_JITTER`` so N objects never
     wake together. Idle cost is then independent of the number of DwdpGroups, up to that resync.
  4. A failed pass never kills the operator: it is retried after ``retry_seconds``, doubling up to
     ``RETRY_CAP_S``. Its log line is one line (``refusals.describe``); a child the API server
     refuses is not a failure but a fact shown on the object: ``status.refusals`` and the
     ChildrenAccepted condition (written by apply), one Warning Event and one log line per distinct
     cause (not per retry).
  6. Pure core, one writer: a pass computes ``desired_state`` exactly once and never writes status
     itself; ``apply.Applier`` is the only writer of status (its invariant).
  5. Every background task is held in ``_tasks`` until done, and every timer in its key's state;
     ``close()`` cancels them all.
  6. Autoscaling (``autoscaler``): a pass of a DwdpGroup with ``spec.autoscaling`` reads its pods' load when
     a decision is due (every ``intervalSeconds``: the pass wakes for it), writes a changed numGroups through
     the scale subresource *before* its status (which records the decision in ``status.autoscaling``), and
     plans with the numGroups it read: the scale write's own event brings the pass that acts on it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine

from dwdp_runtime.contract import DEFAULT_HTTP_PORT

from . import metrics
from .apply import POD_REMEMBER_S, ApiError, Applier, ScaleRefused
from .autoscaler import Autoscaler, Tick
from .desired import desired_state
from .expectations import PodExpectation
from .health import HealthReader
from .refusals import describe
from .state import EventReason, EventType, PlannedEvent

log = logging.getLogger("dwdp_operator.reconcile")
Key = tuple[str, str]  # (namespace, name)
RESYNC_JITTER = 0.2
RETRY_CAP_S = 15.0
# reconciles of different DwdpGroups overlap on these threads (the kubernetes client blocks); more than
# asyncio's default (cpu+4) so N groups created at once are not serialized behind a 2-core machine's 6
IO_THREADS = 16
POD_LIST_WAIT_S = 0.2  # retry a pass that came before the pod informer's first list


@dataclass
class Settings:
    resync_seconds: float = 300.0
    drain_seconds: float = 5.0
    health_interval: float = 10.0
    retry_seconds: float = 2.0
    literal_namespaces: bool = False  # every --namespace is an exact name: no namespace discovery
    namespaces: tuple[str, ...] = ()  # the --namespace values (exact names or kopf patterns); () = all


@dataclass
class _KeyState:
    running: bool = False
    dirty: bool = False
    timer: asyncio.TimerHandle | None = None
    failures: int = 0             # failed passes in a row (retry backoff)
    refused: int = 0              # passes in a row with a refused child (retry backoff)
    last_error: str = ""
    cr_meta: dict | None = None   # name/namespace/uid of the last DwdpGroup read (for Events)
    body: dict | None = None      # the newest DwdpGroup seen (invariant 2); None: GET it
    expect: PodExpectation | None = None  # pods written by the last pass, not yet seen (invariant 2)

    def keep(self, body: dict | None) -> None:
        """Keep ``body`` if it is newer than the copy held (resourceVersions compared as numbers: etcd's
        revisions; one that is not a number is never cached, so those passes GET)."""
        new = _revision(body)
        if new is None:
            return
        old = _revision(self.body)
        if old is None or new >= old:
            self.body = body


def _revision(body: dict | None) -> int | None:
    try:
        return int(((body or {}).get("metadata") or {})["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class Reconciler:
    settings: Settings = field(default_factory=Settings)
    applier: Applier | None = None
    health: HealthReader | None = None
    autoscaler: Autoscaler | None = None
    pods_of: Callable[[Key], list[dict] | None] = lambda key: None
    _state: dict[Key, _KeyState] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    rng: random.Random = field(default_factory=random.Random)
    _io: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(IO_THREADS, thread_name_prefix="dwdp-io"))

    def __post_init__(self) -> None:
        self.applier = self.applier or Applier(parallel=IO_THREADS)
        self.health = self.health or HealthReader(min_interval=self.settings.health_interval)
        self.autoscaler = self.autoscaler or Autoscaler()

    @property
    def keys(self) -> set[Key]:
        return set(self._state)

    def spawn(self, key: Key) -> None:
        """Request a pass without waiting for it (held task, invariant 5)."""
        self._hold(self.request(key))

    def observe(self, key: Key, body: dict) -> None:
        """kopf's event body of a DwdpGroup: the newest copy, if it is (invariant 2)."""
        self._state.setdefault(key, _KeyState()).keep(body)

    def _timer_fired(self, key: Key) -> None:
        st = self._state.get(key)
        if st is not None:
            st.body = None  # a timed pass (resync, backoff, retry) reads the object afresh
        self.spawn(key)

    def _hold(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task) -> None:
        """A held task ended: forget it, and log its error (a pass's own errors are handled inside
        ``request``; what reaches here is an Event that could not be posted, e.g. while the server is away)."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.info("background call failed: %s", describe(task.exception()))

    async def request(self, key: Key) -> None:
        st = self._state.setdefault(key, _KeyState())
        st.dirty = True
        if st.running:
            return
        st.running = True
        try:
            while st.dirty and self._state.get(key) is st:
                st.dirty = False
                try:
                    wake = await self._once(key)
                except Exception as e:  # noqa: BLE001 — invariant 4
                    wake = self._failed(key, st, e)
                else:
                    if st.last_error:
                        log.info("reconcile %s/%s recovered", *key)
                    st.failures, st.last_error = 0, ""
                if self._state.get(key) is st:
                    self._wake_in(key, st, wake)
        finally:
            st.running = False

    def _failed(self, key: Key, st: _KeyState, e: Exception) -> float:
        metrics.RECONCILES.labels("error").inc()
        delay = min(self.settings.retry_seconds * 2 ** st.failures, RETRY_CAP_S)
        st.failures += 1
        line = str(e) if isinstance(e, ApiError) else describe(e)
        if line != st.last_error:  # one line and one Event per distinct error, not per retry
            log.warning("reconcile %s/%s failed: %s; retrying (every <= %.0fs until it succeeds)", *key, line,
                        RETRY_CAP_S)
            st.last_error = line
            if st.cr_meta:
                self._hold(self._blocking(self.applier.event, {"metadata": st.cr_meta}, EventType.WARNING,
                                             EventReason.RECONCILE_ERROR, f"{line}; retrying"))
        else:
            log.debug("reconcile %s/%s failed again: %s", *key, line)
        return delay

    def _wake_in(self, key: Key, st: _KeyState, seconds: float | None) -> None:
        resync = self.settings.resync_seconds * (1 + self.rng.uniform(-RESYNC_JITTER, RESYNC_JITTER))
        delay = resync if seconds is None else min(seconds, resync)
        if st.timer is not None:
            st.timer.cancel()
        st.timer = asyncio.get_running_loop().call_later(max(delay, 0.05), self._timer_fired, key)

    async def _blocking(self, fn, *args, **kwargs):
        """Run a blocking client call on the reconciler's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._io, functools.partial(fn, *args, **kwargs))

    def forget(self, key: Key) -> None:
        st = self._state.pop(key, None)
        if st is not None and st.timer is not None:
            st.timer.cancel()
        self.health.forget(key)
        self.autoscaler.forget(key)

    def close(self) -> None:
        for st in self._state.values():
            if st.timer is not None:
                st.timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        self._io.shutdown(wait=False, cancel_futures=True)

    async def _once(self, key: Key) -> float | None:
        """One pass; returns seconds until the next pass it needs (None: only events or the resync)."""
        ns, name = key
        t0 = time.perf_counter()
        st = self._state.get(key) or _KeyState()
        pods = self.pods_of(key)
        if pods is None:
            return POD_LIST_WAIT_S  # the pods' first list is not in yet: never reconcile blind
        if st.expect is not None:
            wait = st.expect.wait(pods, now=time.monotonic())
            if wait is not None:
                return wait  # the informer's events for our own writes wake the next pass
            st.expect = None
        cr = st.body
        if cr is None:
            cr = await self._blocking(self.applier.get_group, ns, name)
            if cr is None:
                self.forget(key)
                return None
            st.keep(cr)
        meta = cr.get("metadata") or {}
        st.cr_meta = {"name": name, "namespace": ns, "uid": meta.get("uid", "")}
        if meta.get("deletionTimestamp"):
            return None  # garbage collection removes the children (owner references)
        port = int(((cr.get("spec") or {}).get("httpPort")) or DEFAULT_HTTP_PORT)
        health = await self._blocking(self.health.read_all, key, pods, port=port, namespace=ns)
        tick = await self._blocking(self.autoscaler.observe, key, cr, pods, port=port, namespace=ns, now=time.time())
        await self._scale(cr, tick)
        now, token = time.time(), secrets.token_urlsafe(32)
        plan = desired_state(cr, pods, now=now, token=token, health=health, drain_seconds=self.settings.drain_seconds,
                             busy_groups=tick.busy_groups)
        if plan.valid and tick.status is not None:  # invariant 6; {}: spec.autoscaling removed, drop the key
            for status in (plan.status, plan.status_after_creates):
                if status is not None:
                    status["autoscaling"] = tick.status or None
            plan.events += tick.events
        try:
            result = await self._blocking(self.applier.apply, cr, plan, now=now)
        except Exception:
            st.body = None  # a failed apply may have written the status or not: read the object afresh
            raise
        st.keep(result.written)
        st.expect = PodExpectation.after(result.created_pods, result.rolled_back, now=time.monotonic(),
                                         wait_s=POD_REMEMBER_S)
        if result.error is not None:
            st.body = None
            raise result.error
        if plan.valid:
            await self._announce_refusals(cr, result.refusals)
        for action in ("created", "deleted", "patched"):
            if result.counts[action]:
                metrics.CHILDREN.labels(action).inc(result.counts[action])
        for event in plan.events:
            metrics.EVENTS.labels(event.reason).inc()
        metrics.RECONCILES.labels("ok").inc()
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - t0)
        if any(result.counts.values()):
            log.info("reconciled %s/%s: %s", ns, name, result.counts)
        wake = plan.requeue_after
        if tick.wake is not None:
            wake = tick.wake if wake is None else min(wake, tick.wake)
        st.refused = st.refused + 1 if result.refusals else 0
        if result.refusals:  # retried until a person fixed it: backoff up to RETRY_CAP_S
            wake = min(self.settings.retry_seconds * 2 ** (st.refused - 1), RETRY_CAP_S)
        if any(p.get("phase") == "Running" and p.get("ip") for p in pods):
            wake = self.settings.health_interval if wake is None else min(wake, self.settings.health_interval)
        return wake

    async def _scale(self, cr: dict, tick: Tick) -> None:
        """Invariant 6: a changed decision goes to the scale subresource first. Refused (RBAC): the decision
        holds, and the status and a Warning Event say how to fix it; a transient error fails the pass."""
        d = tick.decision
        if d is None or not d.changed or tick.status is None:
            return
        meta = cr["metadata"]
        try:
            await self._blocking(self.applier.scale, meta["namespace"], meta["name"], d.desired)
        except ScaleRefused as e:
            old = (cr.get("status") or {}).get("autoscaling") or {}
            message = f"wanted {d.desired} group(s): {e}"
            tick.status.update(desiredGroups=d.current, message=message)
            if old.get("lastScaleTime"):
                tick.status["lastScaleTime"] = old["lastScaleTime"]
            else:
                tick.status.pop("lastScaleTime", None)
            tick.events = [ev for ev in tick.events if ev.reason not in (EventReason.AUTOSCALE_UP,
                                                                         EventReason.AUTOSCALE_DOWN)]
            if old.get("message") != message:  # one Warning per refusal, not one per tick
                tick.events.append(PlannedEvent(EventType.WARNING, EventReason.AUTOSCALE_FAILED, str(e)))
            return
        log.info("autoscaled %s/%s: numGroups %d -> %d (%s)", meta["namespace"], meta["name"], d.current, d.desired,
                 d.reason)

    async def _announce_refusals(self, cr: dict, refusals: list) -> None:
        """Invariant 4: an Event and a log line per cause that is not on record in ``cr`` (the object
        as the pass read it; apply has written ``status.refusals`` already)."""
        meta = cr["metadata"]
        recorded = list((cr.get("status") or {}).get("refusals") or [])
        if [r.model_dump() for r in refusals] == recorded:
            return
        before = {r.get("reason") for r in recorded}
        for r in refusals:
            if r.reason not in before:
                log.warning("%s/%s: %s refused: %s", meta["namespace"], meta["name"], r.kind, r.message)
                await self._blocking(self.applier.event, cr, EventType.WARNING, r.reason, r.message)
        if not refusals:
            log.info("%s/%s: every child accepted now", meta["namespace"], meta["name"])
