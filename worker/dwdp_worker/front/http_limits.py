"""Bounds on what a client can hold: header time, body time, body size, and uploads cut by shutdown.

Two thin adapters at the HTTP edge:
  * ``GuardedH11Protocol`` (uvicorn's h11 protocol): a request's headers must be complete within
    ``timeouts.HTTP_HEADER_TIMEOUT_S`` of the connection opening or of the previous response ending;
    otherwise the connection gets a JSON 408 and is closed. This bounds silent connections and slowloris
    headers, which uvicorn alone holds forever (its keep-alive timer restarts on every byte).
  * ``BodyGuard`` (ASGI middleware): reads the whole body before the app runs — a declared
    ``Content-Length`` over ``max_bytes`` is a 413 before a byte is read, a streamed body is cut at
    ``max_bytes`` (413), a body not complete within ``timeout_s`` is a 408, and an upload still arriving
    when the HTTP server stops (after the drain) gets a JSON 503 at once (not uvicorn's text/plain 500 after its
    graceful-shutdown timeout). The app then sees the buffered body, and later ``receive`` calls reach the
    server, so a route can wait for ``http.disconnect`` (cancel on client disconnect).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..rank import timeouts
from .http_errors import error_response
from .schemas import error_json

#: ``--max-body-bytes`` default: a 128K-token id list or ~500K characters of text, with room; the largest
#: body also bounds the JSON work done on the event loop (pydantic holds the GIL: ~0.1 s for 2 MiB of ids).
MAX_BODY_BYTES = 2 * 2**20


@dataclass(frozen=True)
class HttpBounds:
    """The front's HTTP bounds (CLI: --max-body-bytes, --header-timeout-s, --body-timeout-s)."""

    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = timeouts.HTTP_HEADER_TIMEOUT_S
    body_timeout_s: float = timeouts.HTTP_BODY_TIMEOUT_S

    def protocol(self) -> type:
        """uvicorn's ``http`` protocol class with this header deadline."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": self.header_timeout_s})


class BodyGuard:
    def __init__(self, app, *, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = timeouts.HTTP_BODY_TIMEOUT_S,
                 stopping: asyncio.Event | None = None):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s
        self.stopping = stopping or asyncio.Event()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if b"transfer-encoding" not in headers and declared in (None, b"0"):
            return await self.app(scope, receive, send)  # no body to bound
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(scope, receive, send, int(declared))
        body = bytearray()
        deadline = time.monotonic() + self.timeout_s
        while True:
            msg = await self._next(receive, deadline)
            if msg is None:
                return await error_response(408, f"the request body did not arrive within {self.timeout_s:g} s",
                                            code="body_timeout")(scope, receive, send)
            if msg == "stopping":
                return await error_response(503, "the server is stopping: this request's body was still arriving; "
                                                 "retry on another replica", type="unavailable",
                                            retry_after_s=timeouts.RETRY_AFTER_STOPPING_S)(scope, receive, send)
            if msg["type"] == "http.disconnect":
                return None  # the client went away before sending its request
            body += msg.get("body", b"")
            if len(body) > self.max_bytes:
                return await self._too_large(scope, receive, send, None)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _next(self, receive, deadline: float):
        """The next message, ``None`` past the deadline, or ``"stopping"`` once the server stops."""
        got = asyncio.ensure_future(receive())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            done, _ = await asyncio.wait({got, stop}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if got in done:
            return got.result()
        got.cancel()
        return "stopping" if stop in done else None

    async def _too_large(self, scope, receive, send, declared: int | None):
        size = f"{declared} bytes" if declared is not None else "more"
        return await error_response(413, f"the request body is {size}; this server takes at most {self.max_bytes} "
                                         f"bytes (--max-body-bytes)", code="body_too_large")(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline per request (see the module docstring)."""

    header_timeout_s = timeouts.HTTP_HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._header_timer = None
        super().connection_made(transport)
        self._arm(self.cycle)

    def _arm(self, waiting_after) -> None:
        self._disarm()
        self._waiting_after = waiting_after  # the cycle before the request whose headers we wait for
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_done(self) -> None:
        if self._header_timer is not None and self.cycle is not self._waiting_after:
            self._disarm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._headers_done()

    def on_response_complete(self) -> None:
        finished = self.cycle
        if not self.transport.is_closing():
            self._arm(finished)
        super().on_response_complete()  # may start a pipelined request at once
        self._headers_done()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.cycle is not self._waiting_after or self.transport.is_closing():
            return
        body = json.dumps(error_json(f"the request headers did not arrive within {self.header_timeout_s:g} s",
                                     code="header_timeout")).encode()
        head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()
