"""Run a front: bind the port, start the ranks, serve HTTP, drain on SIGTERM, return the exit code.

Order (each step bounded)::

    1. bind host:port          (a busy port fails here, before any rank starts: exit 2)
    2. Supervisor.start()      (spawn ranks; /healthz and /readyz answer 503 while they load)
    3. uvicorn serves          (its own signal handling replaced by ours; header/body bounds: http_limits)
    4. wait: SIGTERM/SIGINT → request_drain · a rank dies or loses a peer → Supervisor.fail (exit code 1)
    5. drain                   (admitted requests finish, ≤ drain_timeout_s, or ≤ timeouts.FAILED_DRAIN_S
                                after a failure; then uploads still arriving get a JSON 503)
    6. uvicorn stops           (listener closed first, then LISTEN_CLOSE_GRACE_S for accepted
                                connections, then the rest; ≤ timeouts.SERVER_STOP_S)
    7. ranks stop              (protocol.Stop, join, kill after stop_timeout_s; after a failure: killed)
A second SIGTERM/SIGINT while draining skips the wait (admitted requests get 503, never dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys

import uvicorn

from ..rank import timeouts
from .api import asgi_app
from .http_limits import HttpBounds
from .supervisor import Supervisor

log = logging.getLogger("dwdp_worker.front.serve")



class _Server(uvicorn.Server):
    """uvicorn without its signal handlers (it would stop at once and re-raise SIGTERM at exit), and
    with a shutdown that stops listening *before* it closes connections."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def shutdown(self, sockets=None) -> None:
        # uvicorn closes the listener and every idle connection in the same instant: a request that
        # was already on its way on an accepted connection (or on a keep-alive one) is then reset
        # mid-request. Stop listening first (a new connection is refused: ECONNREFUSED, before any
        # request is sent), give accepted connections a short grace to deliver their request and
        # get an answer (503 + "Connection: close" while draining), then let uvicorn close the rest.
        for server in self.servers:
            server.close()
        await asyncio.sleep(timeouts.LISTEN_CLOSE_GRACE_S)
        await super().shutdown(sockets)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio only sets TCP_NODELAY on accepted sockets whose proto is
    # IPPROTO_TCP, and without it a keep-alive response written in two parts (headers, body)
    # stalls ~40 ms on Nagle + delayed ACK (measured: 44 ms → 0.2 ms per /healthz).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server running there? "
                      f"pick another --port)") from None
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


async def _run(sup: Supervisor, sock: socket.socket, *, log_level: str, bounds: HttpBounds) -> int:
    loop = asyncio.get_running_loop()
    signals = {"count": 0}

    def on_signal(signum, _frame=None):
        signals["count"] += 1
        name = signal.Signals(signum).name
        if signals["count"] == 1:
            loop.call_soon_threadsafe(sup.request_drain, name)
        else:
            log.warning("second %s: stopping without waiting for admitted requests", name)
            sup.drain_timeout_s = 0.0
            loop.call_soon_threadsafe(sup.request_drain, name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    stopping = asyncio.Event()
    server = _Server(uvicorn.Config(asgi_app(sup, bounds, stopping=stopping),
                                    http=bounds.protocol(), log_level=log_level, access_log=False,
                                    timeout_keep_alive=timeouts.HTTP_KEEP_ALIVE_S,
                                    timeout_graceful_shutdown=timeouts.HTTP_GRACEFUL_SHUTDOWN_S, lifespan="off"))
    try:
        await sup.start()
        server_task = asyncio.create_task(server.serve(sockets=[sock]))
        stop_task = asyncio.create_task(sup.wait_stop_requested())
        done, _ = await asyncio.wait({server_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if server_task in done:
            exc = server_task.exception()
            sup.fail(f"the HTTP server stopped unexpectedly: {exc!r}")
        await sup.drain()
        stopping.set()  # uploads still arriving: a JSON 503 now, before uvicorn's shutdown
        server.should_exit = True
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(server_task, timeout=timeouts.SERVER_STOP_S)
        stop_task.cancel()
    finally:
        await sup.stop_ranks()
        for s, h in previous.items():
            signal.signal(s, h)
    if sup.failure:
        print(f"dwdp-worker: error: {sup.failure}", file=sys.stderr)
    return sup.exit_code


def serve(sup: Supervisor, *, host: str, port: int, log_level: str = "info",
          bounds: HttpBounds = HttpBounds()) -> int:
    """Blocking: run the front until drained or failed; the process exit code."""
    try:
        sock = bind(host, port)
    except OSError as exc:
        print(f"dwdp-worker: error: {exc}", file=sys.stderr)
        return 2
    sup.http_port = sock.getsockname()[1]   # the real port (also for --port 0): remote_port of KV responses
    with sock:
        return asyncio.run(_run(sup, sock, log_level=log_level, bounds=bounds))
