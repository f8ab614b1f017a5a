"""The suite's own rules (docs/TESTING.md), checked on its source: a test waits for a condition, never a fixed time.

Every ``time.sleep`` / ``asyncio.sleep`` in ``tests/`` lies inside a loop (the poll of a polling loop); a span of
time that is part of a scenario is ``timing.hold(seconds, why)``, which names why it passes."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: the one module allowed a bare sleep: it defines ``hold``
SLEEP_HOME = TESTS / "timing.py"


def _is_sleep(call: ast.Call) -> bool:
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "sleep":
        return isinstance(f.value, ast.Name) and f.value.id in ("time", "asyncio")
    return isinstance(f, ast.Name) and f.id == "sleep"


def bare_sleeps(source: str) -> list[int]:
    """Lines of sleep calls that are not inside a ``while`` or ``for`` loop of their own function."""
    found: list[int] = []

    def visit(node: ast.AST, in_loop: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)          # a function's body starts outside any loop
            elif isinstance(child, (ast.While, ast.For, ast.AsyncFor)):
                visit(child, True)
            else:
                if isinstance(child, ast.Call) and _is_sleep(child) and not in_loop:
                    found.append(child.lineno)
                visit(child, in_loop)

    visit(ast.parse(source), False)
    return found


def test_the_rule_itself_tells_a_poll_from_a_fixed_wait():
    poll = "import time\nwhile not ready():\n    time.sleep(0.05)\n"
    fixed = "import time\ndef f():\n    start()\n    time.sleep(2)\n    check()\n"
    in_lambda = "import time\nfor x in y:\n    f(after=lambda: time.sleep(1))\n"
    assert bare_sleeps(poll) == [] and bare_sleeps(fixed) == [4] and bare_sleeps(in_lambda) == [3]


def test_no_test_sleeps_a_fixed_time_outside_a_polling_loop():
    offenders = [f"{path.relative_to(TESTS.parent)}:{line}"
                 for path in sorted(TESTS.rglob("*.py")) if path != SLEEP_HOME
                 for line in bare_sleeps(path.read_text())]
    assert not offenders, ("a fixed sleep used as a wait: poll the condition with timing.wait_until, or, where the "
                           "time is part of the scenario, say so with timing.hold(seconds, why): " + ", ".join(offenders))
