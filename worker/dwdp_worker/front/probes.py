"""Liveness and readiness, computed purely from a snapshot of the front's view of its ranks.

``/healthz`` (liveness, also the startup probe): every rank process is alive, has built its engine
and warmed up, and its heartbeat is fresh (``heartbeat_age_s < heartbeat_timeout_s``), busy or idle: a rank beats
from a thread that runs through forwards, so only a frozen or dead rank goes stale (the front's
watchdog then kills it; a forward stuck on the device is bounded by the forward watchdog).
While weights load this is false: the operator's startup probe has a long failure threshold.

``/readyz`` (readiness): live, every rank ready (rendezvous done, weights bound, warm-up forward
done), the tokenizer loaded when the checkpoint has one, and not draining. It turns false the
instant SIGTERM arrives.

A rank *retired* by an elastic group (``retired: true``: it died and its group survives on its replicas,
issue #30), or the replacement process of one that is still loading (``rejoining: true``), does not count against
either: the group serves degraded, and the body says so (``status: degraded``, ``degraded: [its description]``);
a group whose survivors reloaded experts no one held from the checkpoint (``on_uncovered: reload``) adds one line
naming them.

Both answer the same JSON body; it always carries ``prefetch_restarts``, ``group_attempt``,
``forwards`` and ``last_forward_age_s`` (the operator reads ``prefetch_restarts``).
"""

from __future__ import annotations

from typing import Any

from ..kv.metrics import budget_summary


def evaluate(snap: dict[str, Any], *, heartbeat_timeout_s: float) -> tuple[bool, bool, dict[str, Any]]:
    ranks = snap["ranks"]
    retired = [r for r in ranks if r.get("retired")]
    rejoining = [r for r in ranks if r.get("rejoining") and r["alive"]]
    serving = [r for r in ranks if not r.get("retired") and not (r.get("rejoining") and r["alive"])]
    reasons: list[str] = []
    if snap.get("failure"):
        reasons.append(snap["failure"])
    for r in serving:
        who = f"rank {r['global_id']} (group {r['group']}, DWDP rank {r['rank']})"
        if not r["alive"]:
            reasons.append(f"{who} is not running")
        elif r["phase"] != "ready":
            reasons.append(f"{who} is {r['phase']}")
        elif r["heartbeat_age_s"] is not None and r["heartbeat_age_s"] >= heartbeat_timeout_s:
            reasons.append(f"{who} heartbeat is {r['heartbeat_age_s']:.1f} s old (limit {heartbeat_timeout_s:g} s)")
    live = not reasons and bool(serving)
    not_ready = list(reasons)
    if snap.get("draining"):
        not_ready.append("draining: the server is stopping and accepts no new requests")
    if not snap.get("tokenizer_ready", True):
        not_ready.append("tokenizer is loading")
    ready = live and not not_ready
    ages = [r["last_forward_age_s"] for r in ranks if r["last_forward_age_s"] is not None]
    all_up = bool(serving) and all(r["alive"] and r["phase"] == "ready" for r in serving)
    if snap.get("failure"):
        status = "failed"
    elif snap.get("draining"):
        status = "draining"
    elif ready:
        status = "degraded" if retired or rejoining else "ready"
    elif all_up and not live:
        status = "stale"     # every rank is up but a heartbeat is too old
    else:
        status = "starting"  # ranks loading, or the tokenizer still loading
    body = {
        "status": status,
        "live": live,
        "ready": ready,
        "draining": bool(snap.get("draining")),
        "group_attempt": snap.get("group_attempt", 0),
        "prefetch_restarts": sum(int(r.get("prefetch_restarts") or 0) for r in ranks),
        "forwards": sum(int(r.get("forwards") or 0) for r in ranks),
        "last_forward_age_s": round(min(ages), 3) if ages else None,
        "reasons": not_ready,
        "degraded": [f"rank {r['global_id']} (group {r['group']}, DWDP rank {r['rank']}) was lost; its group "
                     f"serves on the other ranks' replicas" for r in retired]
                    + [f"rank {r['global_id']} (group {r['group']}, DWDP rank {r['rank']}) was lost; its replacement "
                       f"is {r['phase']} and rejoins the group" for r in rejoining] + _reloaded(serving),
        "kv": budget_summary(ranks),   # KV handoff budget use over the ranks (None: off)
        "ranks": ranks,
    }
    return live, ready, body


def _reloaded(serving: list[dict[str, Any]]) -> list[str]:
    """One line per group whose serving ranks reloaded experts from the checkpoint (their union)."""
    by_group: dict[int, set[int]] = {}
    for r in serving:
        if r.get("reloaded_experts"):
            by_group.setdefault(r["group"], set()).update(r["reloaded_experts"])
    return [f"group {g} reloaded experts {sorted(e)} from the checkpoint (no surviving holder)"
            for g, e in sorted(by_group.items())]
