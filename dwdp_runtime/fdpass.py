"""Pass file descriptors between the processes of one node over a Unix socket (SCM_RIGHTS).

POSIX-fd memory handles (CUDA ``posix_fd`` and the host backend's memfds) are only meaningful
inside the receiving process once the kernel has duplicated them there: ``socket.send_fds``.

Each rank runs one ``FdServer`` (abstract-namespace socket, so nothing is left on disk) serving
its exported fds, in a fixed order, to any client that proves it holds the group token (HMAC
of a server nonce). Clients call ``fetch_fds``. fds arrive in chunks of at most 250 (the
kernel's SCM_MAX_FD is 253).

``close()`` returns at once: after setting the stop flag it connects to its own socket, which wakes the serving
thread's ``accept`` (a shutdown of a listening Unix socket does not wake a ``poll`` on it), instead of waiting
out the accept timeout — a group formation, replan or replacement closes one server per rank, and the 0.1 s
each cost on average was most of the setup time of a CPU group.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading

_CHUNK = 250
_HDR = struct.Struct("!I")
#: the serving thread re-checks its stop flag this often (a backstop: ``close`` wakes it at once)
ACCEPT_POLL_S = 0.2
#: bound on the wait for the serving thread at close (it may be mid-transfer to a slow client)
CLOSE_JOIN_S = 5.0


class FdPassError(RuntimeError):
    pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise FdPassError("peer closed the fd socket early")
        buf += part
    return buf


class FdServer:
    """Serves ``fds`` to authenticated clients until ``close()``. Owns nothing: the caller closes fds."""

    def __init__(self, fds: list[int], *, token_key: bytes, name: str | None = None):
        self._fds = list(fds)
        self._key = token_key
        self.name = name or f"dwdp-fds-{os.getpid()}-{secrets.token_hex(8)}"
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind("\0" + self.name)
        self._sock.listen(64)
        self._sock.settimeout(ACCEPT_POLL_S)
        self._stop = threading.Event()
        self.served = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._serve, name="dwdp-fd-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (socket.timeout, OSError):
                continue
            if self._stop.is_set():  # close()'s wake-up connection
                conn.close()
                return
            with conn:
                try:
                    conn.settimeout(30)
                    nonce = secrets.token_bytes(16)
                    conn.sendall(nonce)
                    proof = _recv_exact(conn, 32)
                    if not hmac.compare_digest(proof, hmac.new(self._key, nonce, hashlib.sha256).digest()):
                        self.refused += 1
                        conn.sendall(_HDR.pack(0xFFFFFFFF))
                        continue
                    conn.sendall(_HDR.pack(len(self._fds)))
                    for i in range(0, len(self._fds), _CHUNK):
                        chunk = self._fds[i:i + _CHUNK]
                        socket.send_fds(conn, [_HDR.pack(len(chunk))], chunk)
                    _recv_exact(conn, 1)  # ack: the client holds its duplicates now
                    self.served += 1
                except (OSError, FdPassError):
                    continue

    def close(self) -> None:
        self._stop.set()
        try:  # wake a blocked accept (module docstring)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wake:
                wake.settimeout(ACCEPT_POLL_S)
                wake.connect("\0" + self.name)
        except OSError:
            pass  # the backlog is full or the thread is gone: the accept timeout ends it
        self._thread.join(timeout=CLOSE_JOIN_S)
        self._sock.close()


def fetch_fds(name: str, *, token_key: bytes, timeout_s: float = 60.0) -> list[int]:
    """Connect to the ``FdServer`` called ``name`` and receive its fds (the caller owns them)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    fds: list[int] = []
    try:
        sock.connect("\0" + name)
        nonce = _recv_exact(sock, 16)
        sock.sendall(hmac.new(token_key, nonce, hashlib.sha256).digest())
        (count,) = _HDR.unpack(_recv_exact(sock, _HDR.size))
        if count == 0xFFFFFFFF:
            raise FdPassError(f"fd server {name} refused us: token mismatch")
        while len(fds) < count:
            msg, got, _flags, _addr = socket.recv_fds(sock, _HDR.size, _CHUNK)
            if not msg:
                raise FdPassError("fd server closed mid-transfer")
            (n,) = _HDR.unpack(msg)
            if len(got) != n:
                for fd in got:
                    os.close(fd)
                raise FdPassError(f"expected {n} fds in a chunk, got {len(got)}")
            fds.extend(got)
        sock.sendall(b"\1")
        return fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    finally:
        sock.close()
