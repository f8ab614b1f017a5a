"""A fix for kopf's watch-stream stopper, installed by ``cli.main`` before ``kopf.run``.

The defect (kopf 1.45.2, ``kopf/_cogs/clients/api.py::stream``): while a watch request waits for the
API server's headers, the stopper's done-callback ``request_cancel_callback`` is meant to cancel the
request, but it calls ``asyncio.current_task()`` — which is None inside a done-callback — so it raises
``AssertionError`` ("Exception in callback" in the log) and cancels nothing. The request then runs on
through its retry backoffs; when kopf's own shutdown cancels the watcher meanwhile, ``stream`` sees the
stopper done and swallows that cancellation as if it were the stopper's. Found on CI (2026-12-01):
during a kube-apiserver restart the operator's kopf stopped after a 404 but ``kopf.run`` never returned,
so ``cli.py``'s in-process restart never ran.

The fix keeps kopf's own ``stream`` and hands it a stopper that substitutes that one callback by one that
cancels the task which started the stream (captured when ``stream`` is called, in that task); every other
callback and ``done()`` go to the real stopper unchanged. If kopf renames or fixes the callback, nothing
is substituted (``tests/operator/test_op_kopf_fixes.py`` says when the fix can go).

Invariant: installing twice is a no-op; kopf's behaviour is otherwise unchanged.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

#: the name of kopf's broken pre-header callback inside ``api.stream``
BROKEN_CALLBACK = "request_cancel_callback"
_FIXED = "__dwdp_stopper_fixed__"


class TaskBoundStopper:
    """A stopper whose pre-header cancel callback cancels ``task`` (the stream's own task)."""

    def __init__(self, stopper: asyncio.Future, task: asyncio.Task | None) -> None:
        self._stopper = stopper
        self._task = task
        self._substitutes: dict[Callable, Callable] = {}

    def done(self) -> bool:
        return self._stopper.done()

    def add_done_callback(self, callback: Callable[[asyncio.Future], Any]) -> None:
        if getattr(callback, "__name__", "") == BROKEN_CALLBACK and self._task is not None:
            task = self._task
            substitute = self._substitutes.setdefault(callback, lambda _future: task.cancel())
            self._stopper.add_done_callback(substitute)
        else:
            self._stopper.add_done_callback(callback)

    def remove_done_callback(self, callback: Callable[[asyncio.Future], Any]) -> int:
        return self._stopper.remove_done_callback(self._substitutes.pop(callback, callback))

    def __getattr__(self, name: str) -> Any:  # anything else kopf may ask of a future
        return getattr(self._stopper, name)


def install() -> bool:
    """Wrap ``kopf``'s ``api.stream`` (the module attribute its watcher calls); True if newly installed, False if
    already installed or this kopf has no such function (another layout: nothing to mend that we know of)."""
    try:
        from kopf._cogs.clients import api
        original = api.stream
    except (ImportError, AttributeError):
        return False
    if getattr(original, _FIXED, False):
        return False

    @functools.wraps(original)
    def stream(*args: Any, stopper: asyncio.Future | None = None, **kwargs: Any):
        if stopper is not None:
            stopper = TaskBoundStopper(stopper, asyncio.current_task())  # type: ignore[assignment]
        return original(*args, stopper=stopper, **kwargs)

    setattr(stream, _FIXED, True)
    api.stream = stream
    return True
