"""Caches the operator keeps between passes stay bounded by what is live (issue 19: they grew with
every pod uid ever seen)."""

import asyncio

from dwdp_operator.health import HealthReader
from dwdp_operator.reconciler import Reconciler, Settings


def test_health_cache_is_bounded_under_10000_pod_uids_churned():
    h = HealthReader(min_interval=0.0)
    peak = 0
    for i in range(0, 10_000, 4):  # 2,500 restarts of a 4-pod group: new uids every time
        pods = [{"uid": f"u{i + j}", "name": f"r1-g0-p{j}", "phase": "Pending", "ip": ""} for j in range(4)]
        h.read_all(("ns", "r1"), pods, port=8000, namespace="ns")
        h.read_all(("ns", "r2"), pods[:2], port=8000, namespace="ns")
        peak = max(peak, len(h))
    assert peak == 6
    h.forget(("ns", "r1"))
    h.read_all(("ns", "r2"), [], port=8000, namespace="ns")
    assert len(h) == 0


#: 200 spawned passes (each returns at once: the index is not ready) seen done
TASKS_DONE_S = 30.0


def test_reconciler_holds_its_tasks_and_forgets_deleted_groups():
    async def scenario():
        r = Reconciler(settings=Settings(resync_seconds=3600), pods_of=lambda key: None)  # index not ready
        for i in range(200):
            r.spawn(("ns", f"g{i}"))
        assert len(r._tasks) == 200  # held until done, never dropped on the floor
        deadline = asyncio.get_running_loop().time() + TASKS_DONE_S
        while r._tasks and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert not r._tasks and len(r.keys) == 200
        for i in range(200):
            r.forget(("ns", f"g{i}"))
        assert not r.keys
        r.close()
    asyncio.run(scenario())
