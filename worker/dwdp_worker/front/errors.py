"""The errors a request can end with, each with its HTTP status, OpenAI ``type`` and ``Retry-After``.

Raised by admission and dispatch, turned into JSON by ``http_errors`` (one place for the mapping).
"""

from __future__ import annotations

from ..rank import timeouts


class ServeError(Exception):
    status = 500
    kind = "server_error"
    retry_after_s: int | None = None


class Unavailable(ServeError):
    """Draining, failed, or a rank died under the request: retry on another replica."""

    status, kind, retry_after_s = 503, "unavailable", timeouts.RETRY_AFTER_STOPPING_S


class NotReady(Unavailable):
    """Ranks are still starting or loading weights."""

    retry_after_s = timeouts.RETRY_AFTER_NOT_READY_S


class QueueFull(ServeError):
    status, kind, retry_after_s = 429, "queue_full", timeouts.RETRY_AFTER_QUEUE_FULL_S


class KvBudgetFull(ServeError):
    """The rank's KV region has no room for this sequence's KV (``kv_transfer_params``): retry later."""

    status, kind, retry_after_s = 429, "kv_budget_full", timeouts.RETRY_AFTER_QUEUE_FULL_S


class ForwardFailed(ServeError):
    status, kind = 500, "forward_failed"


class BadPrompt(ServeError):
    """The request is well-formed but the model cannot take it (400): the message says what to change."""

    status, kind = 400, "invalid_request_error"

    def __init__(self, message: str, param: str | None = "prompt"):
        super().__init__(message)
        self.param = param
