"""Group rendezvous: ``allgather(key, bytes)``, ``barrier(key)``, ``close()``. Setup-time only.

DWDP has no collective communication at run time; the rendezvous exists only to exchange memory
handles (and fd-server addresses) once at start.

``StoreRendezvous`` — ``torch.distributed.TCPStore`` (replaces MPI inside a pod group):
  * rank 0 hosts the store (``is_master``), others connect to ``host:port``;
  * keys live under ``dwdp/<job>/<group>/<attempt>/<token-tag>/…`` so a rank of an older attempt
    (or another group) never reads or writes this attempt's keys, and a client without the token
    cannot even name them;
  * every value is authenticated with HMAC-SHA256 under the shared token: an entry written by a
    stranger is rejected with a message instead of being trusted;
  * waits are bounded: a timeout names exactly the ranks that never arrived;
  * a rank other than the host first waits for the store's port to accept (``wait_for_port``, polled every
    ``PORT_POLL_S``) and only then builds its ``TCPStore`` client: the client's own retry after a refused connect
    backs off by ~0.1-1 s, so a rank arriving before rank 0 listened lost ~0.4 s per group formation (measured
    on CPU: 28 s of a 70-model support-matrix run).

``MpiRendezvous`` — mpi4py, for ``mpirun``/Slurm launches: the world is split into groups of
``dwdp_size`` consecutive ranks (group = rank // dwdp_size).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import time
from abc import ABC, abstractmethod
from datetime import timedelta

log = logging.getLogger(__name__)

_MAC_BYTES = 32
#: how often a joining rank retries connecting to the store's port while rank 0 is not listening yet
PORT_POLL_S = 0.005
#: one connection attempt's limit (a reachable host answers a connect in well under this)
PORT_CONNECT_S = 1.0


def port_accepts(host: str, port: int, *, connect_s: float = PORT_CONNECT_S) -> bool:
    """Whether ``host:port`` accepts a TCP connection now (closed at once): a refused port answers at once, before
    any TCPStore client, whose own connect retries a refused port with back-off."""
    try:
        socket.create_connection((host, port), timeout=connect_s).close()
        return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, *, timeout_s: float) -> bool:
    """True once ``host:port`` accepts a TCP connection, False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not port_accepts(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(PORT_POLL_S)
    return True


def token_key(token: str) -> bytes:
    """The 32-byte key every authenticated exchange of a group derives from its shared token."""
    return hashlib.sha256(f"dwdp-token:{token}".encode()).digest()


class RendezvousError(RuntimeError):
    """The group could not be formed (a rank missing, a bad token, the store lost)."""


class RendezvousTimeout(RendezvousError):
    def __init__(self, message: str, missing: list[int]):
        super().__init__(message)
        self.missing = missing


class Rendezvous(ABC):
    rank: int
    world_size: int

    @abstractmethod
    def allgather(self, key: str, value: bytes) -> list[bytes]:
        """Every rank's ``value`` for ``key``, indexed by rank. Each key may be used once."""

    def barrier(self, key: str) -> None:
        self.allgather(f"barrier/{key}", b"")

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class GroupKeys:
    """The namespace and the authentication of one group attempt's store entries (pure: no store I/O).

    Keys live under ``dwdp/<job>/<group>/<attempt>/<token-tag>/``; a sealed value is ``HMAC(key, value) +
    value`` under the token, so an entry a stranger wrote is refused when opened. The same keys work on
    any store of the group (its primary and, after a failover, a standby: ``elastic.store_chain``)."""

    def __init__(self, *, job: str, group: int, attempt: int, token: str):
        self._key = token_key(token)
        tag = hashlib.sha256(self._key).hexdigest()[:16]
        self.prefix = f"dwdp/{job}/{group}/{attempt}/{tag}/"

    def full(self, key: str) -> str:
        return self.prefix + key

    def mac(self, full: str, value: bytes) -> bytes:
        return hmac.new(self._key, full.encode() + b"\0" + value, hashlib.sha256).digest()

    def seal(self, key: str, value: bytes) -> bytes:
        return self.mac(self.full(key), value) + value

    def open(self, key: str, raw: bytes, where: str) -> bytes:
        """The payload of a sealed entry; ``RendezvousError`` when its MAC is not this group's."""
        mac, payload = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if not hmac.compare_digest(mac, self.mac(self.full(key), payload)):
            raise RendezvousError(f"the entry {key!r} of {where} failed the token check: written by a "
                                  f"client without this group's token")
        return bytes(payload)


class StoreRendezvous(Rendezvous):
    def __init__(self, *, host: str, port: int, rank: int, world_size: int, job: str = "dwdp",
                 group: int = 0, attempt: int = 0, token: str = "", timeout_s: float = 300.0,
                 poll_s: float = 0.005, store=None, generation: int = 0, host_rank: int = 0):
        """Rank 0 hosts the primary store on ``host:port``, the others connect to it. ``store``: an already
        connected client of the group's *current* store instead (a replacement joining a running elastic group
        finds it with ``elastic.store_chain``), hosted by ``host_rank`` since failover ``generation``."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        self.host, self.port, self.timeout_s, self._poll_s = host, port, timeout_s, poll_s
        self.job, self.group, self.attempt = job, group, attempt
        self.keys = GroupKeys(job=job, group=group, attempt=attempt, token=token)
        self._key = self.keys._key
        self._prefix = self.keys.prefix
        # which store the group uses now: generation 0 is the primary (rank 0's); an elastic group's failover
        # moves it to a standby store of a survivor (``switch_to``)
        self.generation, self.host_rank = generation, host_rank
        self._where = f"group {group} attempt {attempt} (store {host}:{port})"
        if store is None:
            store = self._connect_primary()
        self._store = store
        self._closed = False
        # the ranks the store host waits for at close: all, until an elastic group's membership changes
        # (``elastic.agent.MembershipAgent`` sets it): a lost rank never leaves, and waiting for it would hold
        # the store open for the whole linger while the survivors are long gone
        self.members: frozenset[int] = frozenset(range(world_size))

    def _connect_primary(self):
        from torch.distributed import TCPStore

        try:
            if self.rank != 0 and not wait_for_port(self.host, self.port, timeout_s=self.timeout_s):
                raise TimeoutError("nothing accepted a connection on that port")
            return TCPStore(self.host, self.port, self.world_size, is_master=(self.rank == 0),
                            timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - rewrap with the fix
            who = "host" if self.rank == 0 else "reach"
            raise RendezvousError(f"rank {self.rank} could not {who} the rendezvous store {self.host}:{self.port} "
                                  f"within {self.timeout_s:.0f} s ({exc}); rank 0 hosts it: is it running and "
                                  f"is the port free/reachable?") from exc

    @property
    def where(self) -> str:
        return self._where

    @property
    def store(self):
        """The client of the group's current store (replaced by ``switch_to``)."""
        return self._store

    def switch_to(self, store, *, generation: int, host_rank: int, where: str) -> None:
        """Use ``store`` (a standby promoted to ``generation``, hosted by ``host_rank``) from now on. Calls already
        blocked on the old store stay blocked there (their threads are abandoned: ``elastic.agent``)."""
        if generation <= self.generation:
            raise ValueError(f"store generation {generation} is not newer than {self.generation}")
        self._store, self.generation, self.host_rank = store, generation, host_rank
        self._where = f"group {self.group} attempt {self.attempt} (store {where}, generation {generation})"

    def store_set(self, key: str, value: bytes) -> None:
        """A raw, namespaced set (used by the peer monitor's heartbeats). Like every TCPStore set it is not
        acknowledged: another client sees it once the server has read it, which this client's next request
        guarantees (one connection is served in order); a reader on another client polls."""
        self._store.set(self._prefix + key, value)

    def store_get_nowait(self, key: str) -> bytes | None:
        """A raw, namespaced get that returns None instead of waiting for a missing key."""
        full = self._prefix + key
        store = self._store
        return bytes(store.get(full)) if store.check([full]) else None

    def _mac(self, key: str, value: bytes) -> bytes:
        return self.keys.mac(key, value)

    def store_set_verified(self, key: str, value: bytes) -> None:
        """An authenticated set (opened by ``store_get_verified_nowait`` on any rank)."""
        self._store.set(self._prefix + key, self.keys.seal(key, value))

    def store_claim(self, key: str, value: bytes) -> bytes:
        """Write ``value`` under ``key`` unless some rank wrote it first (``compare_set`` on an absent key:
        atomic in the store); returns the value that won, authenticated. Used once per membership epoch."""
        won = self._store.compare_set(self._prefix + key, "", self.keys.seal(key, value))
        return self.keys.open(key, bytes(won), self._where)

    def store_get_verified_nowait(self, key: str) -> bytes | None:
        """An authenticated ``store_get_nowait`` (an entry without the token's MAC raises)."""
        full = self._prefix + key
        store = self._store
        return self.keys.open(key, bytes(store.get(full)), self._where) if store.check([full]) else None

    def allgather(self, key: str, value: bytes) -> list[bytes]:
        if self._closed:
            raise RendezvousError("rendezvous is closed")
        base = self._prefix + key + "/"
        mine = base + str(self.rank)
        self._store.set(mine, self._mac(mine, value) + value)
        keys = [base + str(r) for r in range(self.world_size)]
        self._wait(keys, key)
        out = []
        for r, k in enumerate(keys):
            raw = self._store.get(k)
            mac, payload = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
            if not hmac.compare_digest(mac, self._mac(k, payload)):
                raise RendezvousError(f"rank {r}'s entry for {key!r} failed the token check in {self._where}: "
                                      f"it was written by a client without this group's token "
                                      f"(check DWDP_TOKEN is the same Secret on every pod)")
            out.append(bytes(payload))
        return out

    def _wait(self, keys: list[str], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        pending = list(range(self.world_size))
        while True:
            try:
                pending = [r for r in pending if not self._store.check([keys[r]])]
            except Exception as exc:  # noqa: BLE001
                raise RendezvousError(f"lost the rendezvous store while waiting for {what!r} in {self._where}: "
                                      f"{exc} (rank 0 hosts the store; did it die?)") from exc
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RendezvousTimeout(
                    f"rendezvous {what!r} timed out after {self.timeout_s:.0f} s in {self._where}: "
                    f"rank(s) {pending} never arrived (of {self.world_size})", pending)
            time.sleep(self._poll_s)

    def __exit__(self, exc_type, *_):
        # after a failure the peers are failing too: do not hold the store open for long
        self.close(linger_s=1.0 if exc_type else 10.0)

    def close(self, *, linger_s: float = 10.0) -> None:
        """Leave the group. The store's host (rank 0, or a standby's after a failover) lingers (bounded) until every
        member left."""
        if self._closed:
            return
        self._closed = True
        try:
            self._store.set(f"{self._prefix}left/{self.rank}", b"1")
            if self.rank == self.host_rank:
                keys = [f"{self._prefix}left/{r}" for r in sorted(self.members)]
                deadline = time.monotonic() + linger_s
                while time.monotonic() < deadline and not self._store.check(keys):
                    time.sleep(self._poll_s)
        except Exception:  # noqa: BLE001 - a dead peer or store must not block teardown
            pass
        finally:
            del self._store


class MpiRendezvous(Rendezvous):
    """Rendezvous over MPI: ``group = world_rank // dwdp_size``, allgather inside the group."""

    def __init__(self, *, dwdp_size: int, comm=None):
        try:
            from mpi4py import MPI
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RendezvousError("MpiRendezvous needs mpi4py and an MPI library (pip install mpi4py mpich)") from exc
        world = comm or MPI.COMM_WORLD
        if world.Get_size() % dwdp_size:
            raise RendezvousError(f"MPI world size {world.Get_size()} is not a multiple of dwdp_size={dwdp_size}")
        self.group = world.Get_rank() // dwdp_size
        self._comm = world.Split(color=self.group, key=world.Get_rank())
        self.rank, self.world_size = self._comm.Get_rank(), self._comm.Get_size()

    def allgather(self, key: str, value: bytes) -> list[bytes]:
        got = self._comm.allgather((key, bytes(value)))
        bad = [r for r, (k, _) in enumerate(got) if k != key]
        if bad:
            raise RendezvousError(f"ranks {bad} reached a different rendezvous step than {key!r}")
        return [v for _, v in got]

    def barrier(self, key: str) -> None:
        self._comm.Barrier()

    def close(self) -> None:
        comm, self._comm = getattr(self, "_comm", None), None
        if comm is not None:
            comm.Free()
