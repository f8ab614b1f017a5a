"""Load progress as log lines: the loader's and the manager's progress bars, reported instead of drawn.

The loader (dense weights, local experts) and ``DwdpManager.setup`` (peer-handle import, composite
mapping) draw ``tqdm.auto.tqdm`` bars when asked for progress. A rank process has no terminal: inside
``report_bars_to(report)`` those bars are ``ReportedBar``s (tqdm bars that draw nothing), which call
``report(step, detail)`` when a bar finishes and at most every ``REPORT_EVERY_S`` while it runs (a
long load is never silent). The rank sends each report to its front, which logs it at info with the
rank's name.

Invariant: only the attribute ``tqdm.auto.tqdm`` is swapped, for the duration of the block, in this
process (the loader and the manager import it at call time). The bar is a real tqdm subclass, so a
library that subclasses ``tqdm.auto.tqdm`` while the block runs (huggingface_hub at import) still gets
a working tqdm.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

#: a running bar reports at most this often: a multi-minute load shows steady progress in the log.
REPORT_EVERY_S = 5.0

Report = Callable[[str, str], None]


class _Discard:
    """A file that drops what tqdm draws (the report is the output)."""

    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def _bar_class(report: Report):
    from tqdm.std import tqdm

    class ReportedBar(tqdm):
        """A tqdm bar that draws nothing and reports when done, and at most every ``REPORT_EVERY_S``."""

        def __init__(self, *args, **kwargs):
            kwargs["file"] = _Discard()
            kwargs.setdefault("mininterval", REPORT_EVERY_S)
            super().__init__(*args, **kwargs)
            self._reported_at = self._t0 = time.monotonic()
            self._report_closed = False

        def _label(self) -> str:
            return (self.desc or "").removeprefix("dwdp: ").rstrip(": ")

        def _count(self) -> str:
            return f"{self.n}/{self.total} {self.unit}" if self.total is not None else f"{self.n} {self.unit}"

        def update(self, n=1):
            out = super().update(n)
            now = time.monotonic()
            if not self.disable and now - self._reported_at >= REPORT_EVERY_S:
                self._reported_at = now
                report(self._label(), f"{self._count()} so far ({now - self._t0:.0f} s)")
            return out

        def close(self):
            if not self.disable and not getattr(self, "_report_closed", True):
                self._report_closed = True
                report(self._label(), f"{self._count()} in {time.monotonic() - self._t0:.1f} s")
            return super().close()

    return ReportedBar


@contextlib.contextmanager
def report_bars_to(report: Report):
    """Within the block, every ``tqdm.auto.tqdm`` bar reports to ``report(step, detail)``."""
    import tqdm.auto

    saved = tqdm.auto.tqdm
    tqdm.auto.tqdm = _bar_class(report)
    try:
        yield
    finally:
        tqdm.auto.tqdm = saved
