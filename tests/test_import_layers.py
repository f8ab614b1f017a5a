"""The worker's rooms import only downward: each subpackage of ``dwdp_worker`` has a floor, and an import
from a module on floor ``a`` into one on floor ``b`` needs ``b <= a`` (its own room, or one below).

    launch      entry points: CLI, local launcher, pod entrypoint, env contract, demo, oracle
    front       the HTTP process: OpenAI routes, admission, dispatch, probes, metrics
    rank        the rank process: engine, generation, protocol, prefill graphs
    kv          the KV handoff (region, store, NIXL server) and its reference client
    checkpoint  safetensors indexes, names, a rank's share onto the meta model, synthetic writers
    model       what DWDP does to a transformers model: discovery, layout, kernels, packing
    dwdp_runtime, below all of them; the operator imports no worker module.

The edges come from ``test_import_cycles.import_graph`` (every import statement, lazy ones too).
"""

from __future__ import annotations

from tests.test_import_cycles import PACKAGES, import_graph

#: the floor of each room (higher imports lower; equal = the same room)
FLOORS = {"launch": 6, "front": 5, "rank": 4, "kv": 3, "checkpoint": 2, "model": 1}
#: the largest room: a folder over this many modules has more than one job (issue #33's bound)
MAX_MODULES_PER_ROOM = 15


def room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "dwdp_worker":
        return None
    return parts[1] if len(parts) > 1 else ""


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for src, targets in graph.items():
        if src.startswith("dwdp_runtime") or src.startswith("dwdp_operator"):
            out += [f"{src} → {t}" for t in targets if t.startswith("dwdp_worker")]
            continue
        here = room_of(src)
        if here is None:
            continue
        for t in targets:
            there = room_of(t)
            if there is None or there == here:
                continue
            if there == "":
                continue  # the package itself (its __init__ holds only a docstring)
            if here == "" or FLOORS[there] > FLOORS[here]:
                out.append(f"{src} ({here or 'top'}) → {t} ({there or 'top'})")
    return sorted(out)


def test_every_module_lives_in_a_room_with_a_floor():
    graph = import_graph(PACKAGES)
    loose = [m for m in graph if room_of(m) == "" and m != "dwdp_worker"]
    assert not loose, f"modules directly under dwdp_worker/ (put each in its room): {loose}"
    rooms = {room_of(m) for m in graph if room_of(m)}
    assert rooms == set(FLOORS), f"rooms without a floor in FLOORS, or floors without a room: {rooms ^ set(FLOORS)}"


def test_imports_only_go_downward():
    edges = upward_edges(import_graph(PACKAGES))
    assert not edges, "upward import(s) (move the shared piece down a floor): " + "; ".join(edges)


def test_no_room_is_over_its_size():
    root = PACKAGES["dwdp_worker"]
    sizes = {str(d.relative_to(root)): sum(1 for f in d.glob("*.py") if f.name != "__init__.py")
             for d in root.rglob("*") if d.is_dir() and (d / "__init__.py").exists()}
    big = {f: n for f, n in sizes.items() if n > MAX_MODULES_PER_ROOM}
    assert not big, f"folders over {MAX_MODULES_PER_ROOM} modules: {big}"


def test_the_checker_sees_an_upward_edge():
    graph = {"dwdp_worker.model.packing": {"dwdp_worker.rank.engine"}, "dwdp_worker.rank.engine": {"dwdp_worker.model.packing"},
             "dwdp_runtime.manager": {"dwdp_worker.model.hooks"}}
    assert upward_edges(graph) == ["dwdp_runtime.manager → dwdp_worker.model.hooks",
                                   "dwdp_worker.model.packing (model) → dwdp_worker.rank.engine (rank)"]
