"""Suite-wide rules (docs/TESTING.md):

* Hypothesis is deterministic by default (profile ``ci``: the same examples every run, no example database), so a
  property test fails on a change, never on a draw; ``HYPOTHESIS_PROFILE=explore`` draws anew and more widely.
* Under pytest-xdist (``scripts/test.sh`` runs two workers) every worker draws its ports from its own slice
  (``DWDP_PORT_RANGE``, read by ``dwdp_runtime.ports``, also in the processes a test starts): a port is checked free
  when drawn and bound later, and two workers drawing at once could otherwise draw the same one in between.
* Tests are dealt to the workers a module at a time (module fixtures start their servers once), and every k8s test
  to one worker: the k8s suite shares one control plane on fixed ports (``tests/k8s/conftest.py``).
* A failed run ends with the first lines of each failure's own message (the wait helpers put the condition and
  what they last saw there), so a CI log's end names what went wrong without scrolling.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from dwdp_runtime import ports

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

K8S_DIR = Path(__file__).parent / "k8s"
#: of each failure's message, the first lines repeated at the end of the run (the wait helpers put what they
#: waited for and what they last saw there) and the characters kept of each
FAILURE_HEAD_LINES = 4
FAILURE_LINE_CHARS = 600


def worker_port_range(index: int, count: int, whole: tuple[int, int]) -> tuple[int, int]:
    """Worker ``index`` of ``count``'s slice of ``whole`` (inclusive bounds; slices are disjoint and cover it)."""
    low, high = whole
    size = (high - low + 1) // count
    return low + index * size, (high if index == count - 1 else low + (index + 1) * size - 1)


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # cut from DWDP_PORT_RANGE, else from the floor up to the ephemeral range (ports.py says why)
        whole = ports.configured_range() or (ports.PORT_FLOOR, ports.ephemeral_range()[0] - 1)
        low, high = worker_port_range(int(worker.removeprefix("gw")),
                                      int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), whole)
        os.environ[ports.PORT_RANGE_ENV] = f"{low}-{high}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before xdist reads them (``--dist loadgroup``): one group per module, one for the whole k8s suite."""
    for item in items:
        path = Path(str(item.fspath))
        group = "k8s" if K8S_DIR in path.parents else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    failed = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
    if not failed:
        return
    terminalreporter.section("what failed, in short")
    for rep in failed:
        text = getattr(rep, "longreprtext", "") or str(rep.longrepr)
        said = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
        terminalreporter.write_line(f"{rep.nodeid} ({rep.when}):")
        for line in (said or text.splitlines()[-FAILURE_HEAD_LINES:])[:FAILURE_HEAD_LINES]:
            terminalreporter.write_line(f"    {line[:FAILURE_LINE_CHARS]}")
