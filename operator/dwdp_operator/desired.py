"""``desired_state(cr, pods, now=…)``: the pure core of the operator — observed world in, plan out.

No I/O, no clock (``now`` is an argument), no randomness except the token passed in. Level-
triggered: the plan depends only on the DwdpGroup (spec + the status it wrote last time) and the
pods that exist now, so running it twice, or after an operator restart, gives the same plan.

Per group g the phase machine (status.groups[g].phase):

    (new) ──► Pending ──all pods ready──► Ready
                 ▲  ▲                       │ pod Failed/Succeeded/deleted/missing, container restart
                 │  │                       ▼
                 │  └── restartAt passed ◄─ Restarting ◄─(groupRestarts < maxRestarts)
                 │      and no pods left         │
                 │                               └─(budget spent)──► Failed (pods deleted)
                 └── no pods left ◄── Updating ◄── template hash changed (≤ maxUnavailableGroups at once;
                                                   groups already unavailable roll at once)
    g ≥ numGroups: Draining (pods leave the client Service) ──drainUntil──► pods deleted ──► removed

Invariants:
  1. A new attempt's pods are created only when no pod of the group is left (pod names are reused,
     and a stale rank must never meet a new one); attempt+1 is written to status before any pod of
     it exists (apply writes status first), so a crash never creates two attempts.
  2. ``gangComplete`` (status) is set once every pod of the attempt existed; after that a missing
     pod is a failure, even when every pod of the group vanished at once.
  3. ``groupRestarts`` counts restarts since the group's last rollout; ``history`` keeps the last 10.
  4. An invalid spec yields a status-only plan (condition Invalid + one Event per new message).
  5. Plans are ordered for apply: status, deletes, creates, patches, events.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import labels as L
from . import manifests as M
from .restart import backoff_seconds, exhausted
from .spec import DwdpGroupSpec, parse_spec
from .sizing import sizing_status
from .status import aggregate, conditions_for, invalid_conditions, iso, parse_iso

HISTORY = 10


@dataclass
class Plan:
    status: dict[str, Any]
    creates: list[dict[str, Any]] = field(default_factory=list)      # manifests; AlreadyExists is fine
    deletes: list[tuple[str, str]] = field(default_factory=list)     # (kind, name); NotFound is fine
    patches: list[tuple[str, dict]] = field(default_factory=list)    # (pod name, merge patch)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    valid: bool = True


def desired_state(cr: dict[str, Any], pods: list[dict[str, Any]], *, now: float, token: str = "",
                  health: dict[str, int] | None = None, drain_seconds: float = 5.0) -> Plan:
    """Children and actions for one DwdpGroup. ``pods``: ``observed.slim_pod`` of its pods;
    ``health``: pod uid -> prefetch_restarts read from the pod's /healthz (missing = unknown)."""
    meta = cr.get("metadata") or {}
    name, ns, uid = meta["name"], meta.get("namespace", "default"), meta.get("uid", "")
    gen = meta.get("generation")
    old = dict(cr.get("status") or {})
    spec, errors = parse_spec(cr.get("spec"))
    if errors or spec is None:
        return _invalid(old, errors, now=now, generation=gen)

    thash = M.template_hash(spec)
    ctx = _Ctx(name=name, ns=ns, uid=uid, spec=spec, thash=thash, now=now, health=health or {},
               drain_seconds=drain_seconds)
    plan = Plan(status={})
    plan.creates += [M.token_secret(name=name, ns=ns, uid=uid, token=token),
                     M.client_service(name=name, ns=ns, uid=uid, spec=spec)]
    if spec.imex.mode == "ComputeDomain":
        plan.creates.append(M.compute_domain(name=name, ns=ns, uid=uid))

    by_group: dict[int, list[dict]] = {}
    for p in pods:
        if p.get("group") is None or p.get("attempt") is None:
            plan.deletes.append(("Pod", p["name"]))  # ours by label but malformed: never adopt
            continue
        by_group.setdefault(p["group"], []).append(p)
    old_groups = {int(g["index"]): dict(g) for g in old.get("groups") or [] if "index" in g}
    indices = sorted(set(range(spec.numGroups)) | set(old_groups) | set(by_group))

    groups: list[dict] = []
    outdated: list[dict] = []
    for g in indices:
        gpods = by_group.get(g, [])
        if g < spec.numGroups:
            st = old_groups.get(g) or _new_group(g, thash)
            st = _live_group(ctx, plan, st, gpods)
            if st["phase"] in ("Pending", "Ready") and st.get("templateHash") != thash:
                outdated.append(st)
            groups.append(st)
        else:
            st = _surplus_group(ctx, plan, old_groups.get(g) or _new_group(g, thash), gpods,
                                known=g in old_groups)
            if st is not None:
                groups.append(st)

    _roll(ctx, plan, outdated, groups, by_group)
    for st in groups:
        if st["index"] < spec.numGroups or st["phase"] == "Draining":
            plan.creates.append(M.group_service(name=name, ns=ns, uid=uid, g=st["index"], spec=spec))
            plan.creates.append(M.network_policy(name=name, ns=ns, uid=uid, g=st["index"], spec=spec))

    agg = aggregate(groups, num_groups=spec.numGroups)
    still_outdated = sum(1 for st in groups if st.get("templateHash") != thash and st["index"] < spec.numGroups)
    plan.status = {
        "observedGeneration": gen, **agg, "selector": L.selector(name), "templateHash": thash,
        "groups": groups,
        "conditions": conditions_for(groups, num_groups=spec.numGroups, outdated=still_outdated,
                                     old=old.get("conditions"), now=now, generation=gen),
    }
    sized = sizing_status(spec)
    if sized is not None:
        plan.status["sizing"] = sized
    return plan


@dataclass
class _Ctx:
    name: str
    ns: str
    uid: str
    spec: DwdpGroupSpec
    thash: str
    now: float
    health: dict[str, int]
    drain_seconds: float


def _new_group(g: int, thash: str) -> dict[str, Any]:
    return {"index": g, "attempt": 0, "phase": "Pending", "templateHash": thash, "gangComplete": False, "pods": 0,
            "readyPods": 0, "podRestarts": 0, "groupRestarts": 0, "prefetchRestarts": 0, "history": []}


def _delete_all(plan: Plan, gpods: list[dict]) -> None:
    plan.deletes += [("Pod", p["name"]) for p in gpods if not p["deleting"]]


def _failure_reasons(ctx: _Ctx, st: dict, cur: list[dict]) -> list[str]:
    reasons = []
    for p in sorted(cur, key=lambda p: p["name"]):
        if p["deleting"]:
            reasons.append(f"pod {p['name']} deleted")
        elif p["phase"] in ("Failed", "Succeeded"):
            reasons.append(f"pod {p['name']} {p['phase']}")
        elif p["restarts"] > 0:
            reasons.append(f"pod {p['name']} container restarted ({p['restarts']}x)")
    dead_end = _placement_dead_end(ctx, cur)
    if dead_end:
        reasons.append(dead_end)
    if st.get("gangComplete") or any(p["labels"].get(L.GANG) == "complete" for p in cur):
        have = {p["name"] for p in cur}
        for i in range(ctx.spec.pods_per_group):
            n = M.pod_name(ctx.name, st["index"], i)
            if n not in have:
                reasons.append(f"pod {n} disappeared")
    return reasons


def _placement_dead_end(ctx: _Ctx, cur: list[dict]) -> str:
    """A group split between bound pods and a pod no node can take (the bound ones pin the clique)."""
    limit = ctx.spec.restartPolicy.unschedulableSeconds
    bound = sorted({p["node"] for p in cur if p["node"] and not p["deleting"]})
    stuck = [p for p in cur if not p["node"] and p.get("unschedulable_since")]
    if not limit or not bound or not stuck:
        return ""
    since = min(parse_iso(p["unschedulable_since"]) or ctx.now for p in stuck)
    if ctx.now - since < limit:
        return ""
    return (f"placement dead end: pod {stuck[0]['name']} unschedulable for {ctx.now - since:.0f}s while the "
            f"group's other pods hold {', '.join(bound)}; restarting away from those nodes")


def _live_group(ctx: _Ctx, plan: Plan, st: dict, gpods: list[dict]) -> dict:
    """One desired group (index < numGroups)."""
    g, spec, now = st["index"], ctx.spec, ctx.now
    phase = st.get("phase", "Pending")
    if phase == "Draining":  # scaled back up while draining: keep the pods, serve again
        phase = st["phase"] = "Pending"
        st.pop("drainUntil", None)
        plan.events.append(("Normal", "ScaleUp", f"group {g} kept (scaled back up while draining)"))
    cur = [p for p in gpods if p["attempt"] == st["attempt"]]
    stale = [p for p in gpods if p["attempt"] != st["attempt"]]
    _delete_all(plan, stale)

    if phase == "Failed":
        _delete_all(plan, gpods)
        if st.get("templateHash") != ctx.thash:  # a new template earns a fresh restart budget
            st.update(phase="Updating", restartAt=iso(now), groupRestarts=0)
            plan.events.append(("Normal", "RollingUpdate", f"group {g}: failed group retried with the new template"))
        return _observe(ctx, st, [])

    if phase in ("Restarting", "Updating"):
        _delete_all(plan, gpods)
        due = parse_iso(st.get("restartAt")) or 0.0
        if gpods or now < due:
            return _observe(ctx, st, [])
        st.update(attempt=int(st["attempt"]) + 1, phase="Pending", templateHash=ctx.thash, gangComplete=False)
        st.pop("restartAt", None)
        cur, gpods = [], []
        plan.events.append(("Normal", "GroupCreated", f"group {g} attempt {st['attempt']}: creating "
                                                      f"{spec.pods_per_group} pods"))

    reasons = _failure_reasons(ctx, st, cur)
    if reasons:
        why = "; ".join(reasons)
        n = int(st.get("groupRestarts") or 0)
        hist = list(st.get("history") or [])[-(HISTORY - 1):] + [{"attempt": int(st["attempt"]), "time": iso(now), "reason": why}]
        st.update(history=hist, lastRestartTime=iso(now), lastRestartReason=why)
        if why.startswith("placement dead end") or "; placement dead end" in why:
            st["avoidNodes"] = sorted({p["node"] for p in cur if p["node"]})
        else:
            st.pop("avoidNodes", None)
        _delete_all(plan, gpods)
        if exhausted(n, max_restarts=spec.restartPolicy.maxRestarts):
            st["phase"] = "Failed"
            st.pop("restartAt", None)
            plan.events.append(("Warning", "GroupFailed",
                                f"group {g} attempt {st['attempt']} failed ({why}); restart budget "
                                f"maxRestarts={spec.restartPolicy.maxRestarts} spent"))
        else:
            delay = backoff_seconds(n, base=spec.restartPolicy.backoffSeconds)
            st.update(phase="Restarting", groupRestarts=n + 1, restartAt=iso(now + delay))
            plan.events.append(("Warning", "GroupRestart",
                                f"group {g} attempt {st['attempt']} failed ({why}); restart "
                                f"{n + 1}/{spec.restartPolicy.maxRestarts} in {delay:g}s"))
        return _observe(ctx, st, [])

    if st.get("templateHash") != ctx.thash:  # rolled (or not yet) by _roll, within the budget
        st = _observe(ctx, st, cur)
        st["phase"] = "Ready" if st["readyPods"] == spec.pods_per_group else "Pending"
        return st

    # create what is missing, then lift the gang gate once every pod of the attempt exists
    have = {p["name"] for p in gpods}
    for i in range(spec.pods_per_group):
        n = M.pod_name(ctx.name, g, i)
        if n not in have:
            plan.creates.append(M.worker_pod(name=ctx.name, ns=ctx.ns, uid=ctx.uid, g=g, i=i,
                                             attempt=int(st["attempt"]), spec=spec, thash=ctx.thash,
                                             avoid_nodes=st.get("avoidNodes") or ()))
    if len(cur) == spec.pods_per_group:
        st["gangComplete"] = True  # from now on a missing pod is a failure, even if all vanish
        plan.patches += [(p["name"], M.lift_gate_patch()) for p in cur if p["labels"].get(L.GANG) != "complete"]
    plan.patches += [(p["name"], M.serving_patch(True)) for p in cur if p["labels"].get(L.SERVING) != "true"]
    st = _observe(ctx, st, cur)
    st["phase"] = "Ready" if st["readyPods"] == spec.pods_per_group else "Pending"
    if st["phase"] == "Ready":
        st.pop("avoidNodes", None)  # placed: the next restart may use any node again
    return st


def _surplus_group(ctx: _Ctx, plan: Plan, st: dict, gpods: list[dict], *, known: bool) -> dict | None:
    """A group beyond numGroups: drain it, delete it, then forget it (None)."""
    g = st["index"]
    if not gpods:
        if known:
            plan.events.append(("Normal", "ScaleDown", f"group {g} removed"))
        plan.deletes.append(("Service", M.group_service_name(ctx.name, g)))
        plan.deletes.append(("NetworkPolicy", M.network_policy_name(ctx.name, g)))
        return None
    if st.get("phase") != "Draining":
        st.update(phase="Draining", drainUntil=iso(ctx.now + ctx.drain_seconds))
        st.pop("restartAt", None)
        plan.events.append(("Normal", "ScaleDown", f"group {g} draining: removed from the client Service, "
                                                   f"deleted in {ctx.drain_seconds:g}s"))
    plan.patches += [(p["name"], M.serving_patch(False)) for p in gpods
                     if p["labels"].get(L.SERVING) != "false" and not p["deleting"]]
    if ctx.now >= (parse_iso(st.get("drainUntil")) or 0.0):
        _delete_all(plan, gpods)
    cur = [p for p in gpods if p["attempt"] == st.get("attempt")]
    return _observe(ctx, st, cur)


def _roll(ctx: _Ctx, plan: Plan, outdated: list[dict], groups: list[dict], by_group: dict) -> None:
    """Start rolling outdated groups: unavailable ones at once, Ready ones within the budget."""
    live = [st for st in groups if st["index"] < ctx.spec.numGroups]
    for st in [s for s in outdated if s["phase"] != "Ready"]:
        _start_update(ctx, plan, st, by_group.get(st["index"], []))
    unavailable = sum(1 for st in live if st["phase"] != "Ready")
    budget = ctx.spec.rollout.maxUnavailableGroups - unavailable
    for st in sorted([s for s in outdated if s["phase"] == "Ready"], key=lambda s: -s["index"]):
        if budget <= 0:
            break
        _start_update(ctx, plan, st, by_group.get(st["index"], []))
        budget -= 1


def _start_update(ctx: _Ctx, plan: Plan, st: dict, gpods: list[dict]) -> None:
    _delete_all(plan, gpods)
    st.update(phase="Updating", restartAt=iso(ctx.now), readyPods=0)
    plan.events.append(("Normal", "RollingUpdate", f"group {st['index']}: replacing attempt {st['attempt']} "
                                                   f"with template {ctx.thash}"))


def _observe(ctx: _Ctx, st: dict, cur: list[dict]) -> dict:
    live = [p for p in cur if not p["deleting"]]
    st["pods"] = len(live)
    st["readyPods"] = sum(1 for p in live if p["ready"] and p["phase"] == "Running")
    st["podRestarts"] = sum(p["restarts"] for p in cur)
    known = [ctx.health[p["uid"]] for p in live if p["uid"] in ctx.health]
    if known:
        st["prefetchRestarts"] = int(sum(known))
    st.setdefault("prefetchRestarts", 0)
    st.setdefault("groupRestarts", 0)
    st.setdefault("history", [])
    return st


def _invalid(old: dict, errors: list[str], *, now: float, generation: int | None) -> Plan:
    status = dict(old)
    prev = next((c for c in old.get("conditions") or [] if c.get("type") == "Invalid"), None)
    status["observedGeneration"] = generation
    status["conditions"] = invalid_conditions(errors, old=old.get("conditions"), now=now, generation=generation)
    msg = "; ".join(errors)
    plan = Plan(status=status, valid=False)
    if not prev or prev.get("status") != "True" or prev.get("message") != msg:
        plan.events.append(("Warning", "InvalidSpec", msg))
    return plan
