"""No import circle in the project: the import graph of dwdp_runtime, dwdp_worker and dwdp_operator,
read with ``ast`` (every ``import`` statement: module level, inside functions, under
``TYPE_CHECKING``), has no cycle.

An edge ``a → b`` is an explicit import of project module ``b`` by module ``a``
(``from .x import y`` → ``pkg.x``; ``from . import x`` → ``pkg.x`` when ``x`` is a module, else
``pkg``). The implicit import of a parent package's ``__init__`` is not an edge: Python runs it once,
before any of its submodules, so it cannot close a circle that the explicit edges don't.
A function-level import counts: a lazy import that exists only to dodge a circle is still one
(the two modules cannot be understood, tested or moved apart).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = {"dwdp_runtime": ROOT / "dwdp_runtime", "dwdp_worker": ROOT / "worker" / "dwdp_worker",
            "dwdp_operator": ROOT / "operator" / "dwdp_operator"}

# Known circles, each named with what removes it (none today: keep it that way). The test
# fails on any other circle, and on an entry here that no longer exists (then delete the entry).
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


def project_modules(packages: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """``{dotted module name: file}`` for every ``.py`` file of the packages."""
    out = {}
    for name, root in packages.items():
        for path in sorted(root.rglob("*.py")):
            parts = [name, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_package(module: str, modules: dict[str, pathlib.Path]) -> bool:
    return modules[module].name == "__init__.py"


def imports_of(module: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file."""
    tree = ast.parse(modules[module].read_text(), filename=str(modules[module]))
    here = module if _is_package(module, modules) else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    out.add(sub)
                elif target in modules:
                    out.add(target)
    out.discard(module)
    return out


def import_graph(packages: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    modules = project_modules(packages)
    return {m: imports_of(m, modules) for m in modules}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, …, a]``) per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan; the graph is small (recursion depth < number of modules)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(comp, graph) for comp in components]


def _cycle_in(comp: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first inside the component)."""
    start = min(comp)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"component {sorted(comp)} has no cycle through {start}")  # pragma: no cover


def test_the_project_has_no_import_circle():
    graph = import_graph(PACKAGES)
    assert {"dwdp_runtime.contract", "dwdp_worker.launch.envcontract", "dwdp_operator.spec"} <= set(graph)
    assert "dwdp_runtime.contract" in graph["dwdp_worker.launch.envcontract"]  # the graph sees real edges
    found = {frozenset(c): c for c in find_cycles(graph)}
    new = [" → ".join(c) for key, c in found.items() if key not in ALLOWED_CYCLES]
    assert not new, "import circle(s): " + "; ".join(new) + " (move the shared piece into its own module)"
    gone = [f"{sorted(key)}: {why}" for key, why in ALLOWED_CYCLES.items() if key not in found]
    assert not gone, f"allowed circle(s) are gone, delete them from ALLOWED_CYCLES: {gone}"


def test_cycle_finder_sees_a_function_level_circle(tmp_path):
    """The checker itself: a circle through a lazy import inside a function is reported by name."""
    pkg = tmp_path / "toy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n    return c\n")
    (pkg / "c.py").write_text("import toy.a\n")
    (pkg / "d.py").write_text("from toy import a\nfrom .a import f\n")  # imports the circle, is not in it
    graph = import_graph({"toy": pkg})
    assert graph["toy.b"] == {"toy.c"} and graph["toy.d"] == {"toy.a"}
    assert find_cycles(graph) == [["toy.a", "toy.b", "toy.c", "toy.a"]]
    (pkg / "c.py").write_text("")
    assert find_cycles(import_graph({"toy": pkg})) == []


#: the benchmarks: a package of scripts that import the project and each other
BENCH = {"bench": ROOT / "bench"}


def test_the_benchmarks_have_no_import_circle():
    graph = import_graph({**PACKAGES, **BENCH})
    assert "bench.ranks" in graph.get("bench.prefill", set())  # the graph sees the benchmarks' edges
    circles = [" → ".join(c) for c in find_cycles(graph) if any(m.startswith("bench.") for m in c)]
    assert not circles, "import circle(s) among the benchmarks: " + "; ".join(circles)


def test_tests_import_no_private_benchmark_helper():
    """A test holds a benchmark to what it offers (its public names), never to a helper it may change."""
    private = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench"):
                private += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_")]
    assert not private, "private benchmark helpers imported by tests: " + ", ".join(private)
