"""Store chain: where an elastic group's rendezvous store lives, and where survivors move it when its host is lost.

Why: a group's store (a torch ``TCPStore``) lives in one rank's process — rank 0's at formation. An elastic group
(issue #30) survives the loss of any rank, rank 0 included, so its store must be able to move.

How:
  1. every rank of an elastic group hosts a *standby* store (``StandbyStore``) on ``contract.standby_store_port`` at
     its own address (``standby_endpoints``), empty and unused until promoted;
  2. the store a group uses holds the sealed entry ``active`` = ``ActiveStore(generation, host_rank)``: generation 0
     on the primary (rank 0 writes it at formation: ``mark_formed``), g+1 on the standby the failover after g
     promoted, and ``formed`` once the group exists;
  3. failover (``promote_successor``): the survivors try the members of their last membership but the lost host,
     ascending — the same order on every survivor — and promote the first standby that answers by compare-and-set
     of ``active``: the first survivor to arrive promotes it, the others find it promoted and use it too; when none
     answered, the ones that listen but were slow are tried once more with a longer limit (a loaded node);
  4. a starting rank of an elastic group asks every endpoint for ``active`` (``find_active``) and takes the highest
     generation of a formed group: a replacement joins the running group there instead of forming a new one (rank
     0's replacement would otherwise host an empty primary store and wait for a formation that never comes).

Driver reason for the bounded calls: a TCPStore client blocks without end on a frozen server (SIGSTOP, a hung node:
the kernel accepts the connection and nothing answers; measured with torch 2.13, whose client timeout bounds
neither the connect handshake nor ``check``). Every call here that may meet a frozen server runs in a daemon thread
that is abandoned at its deadline (``bounded``); a refused connection (nothing listening) fails at once.

Invariants: generations only grow; a standby is promoted at most once (compare-and-set on an absent key); every
entry is sealed with the group token (``rendezvous.GroupKeys``), so a store a stranger filled is never taken.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence, TypeVar

from ..contract import standby_store_port
from ..rendezvous import GroupKeys, RendezvousError, port_accepts

log = logging.getLogger(__name__)

T = TypeVar("T")

#: one endpoint's connect-and-read during a failover or a search: a live store answers in milliseconds on a node
#: and well under a second across a rack; a frozen one never does, and the next candidate must be tried before the
#: issue's 5 s bound for serving again is spent
PROBE_TIMEOUT_S = 1.0
#: the second, patient pass of a failover over the candidates that did not answer within ``PROBE_TIMEOUT_S`` (not
#: those that refused the connection, failed the token check or were promoted before): a live standby on a loaded
#: node can take longer to accept — over 1.5 s measured on a 2-core CI machine running a dozen ranks — and a failover
#: that gives up loses the whole group (minutes of reload) where a few more seconds keep it serving
PATIENT_PROBE_TIMEOUT_S = 4.0
#: the raw TCP connect that tells "nothing listens" (refused at once) from "something listens" before the TCPStore
#: client, whose own connect retries a refused port until its timeout
TCP_CONNECT_TIMEOUT_S = 0.5
ACTIVE_KEY = "store/active"
FORMED_KEY = "store/formed"


class StoreUnreachable(RendezvousError):
    """No endpoint of the chain answered in time."""


class StoreSlow(StoreUnreachable):
    """Something listens at the endpoint but did not answer in time (frozen, or slow: a patient retry may reach it)."""


@dataclass(frozen=True)
class Endpoint:
    """Where one store listens: the primary (``rank`` None) or the standby of ``rank``."""

    host: str
    port: int
    rank: int | None = None

    def describe(self) -> str:
        who = "primary" if self.rank is None else f"rank {self.rank}'s standby"
        return f"{who} {self.host}:{self.port}"


@dataclass(frozen=True)
class ActiveStore:
    """The ``active`` entry of a store the group uses: since which failover generation, hosted by which rank."""

    generation: int
    host_rank: int

    def encode(self) -> bytes:
        return json.dumps({"generation": self.generation, "host_rank": self.host_rank}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "ActiveStore":
        d = json.loads(raw)
        return cls(int(d["generation"]), int(d["host_rank"]))


@dataclass
class Found:
    """A live, formed store of the group: its client, where it is, what its ``active`` entry says."""

    store: Any
    endpoint: Endpoint
    active: ActiveStore


def rank_host(rank: int, *, store_host: str, pod_addr_template: str | None, gpus_per_pod: int) -> str:
    """The address rank ``rank`` answers at: its pod's (``{pod}`` = rank // gpus_per_pod in the operator's template,
    ``contract.ElasticEnv.POD_ADDR_TEMPLATE``), or the store host's when every rank shares it (local launcher, one
    pod per group). Pure."""
    if pod_addr_template is None:
        return store_host
    return pod_addr_template.format(pod=rank // gpus_per_pod)


def standby_endpoints(*, world_size: int, store_host: str, store_port: int, pod_addr_template: str | None = None,
                      gpus_per_pod: int = 1) -> tuple[Endpoint, ...]:
    """Every rank's standby store, by rank (pure)."""
    return tuple(Endpoint(rank_host(r, store_host=store_host, pod_addr_template=pod_addr_template,
                                    gpus_per_pod=gpus_per_pod), standby_store_port(store_port, r), r)
                 for r in range(world_size))


def successors(standbys: Sequence[Endpoint], *, lost_host: int, members: Iterable[int]) -> list[Endpoint]:
    """The standbys a failover tries, in order: the members but the lost host, ascending (pure; every survivor
    computes the same list from the same membership)."""
    return [standbys[r] for r in sorted(set(members) - {lost_host})]


def bounded(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """``fn()`` in a daemon thread; ``TimeoutError`` at ``timeout_s`` (the thread is abandoned: module docstring)."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box.append((False, exc))

    t = threading.Thread(target=run, name="dwdp-store-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise TimeoutError(f"{what}: no answer within {timeout_s:g} s (frozen or unreachable)")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def connect(endpoint: Endpoint, *, timeout_s: float = PROBE_TIMEOUT_S):
    """A TCPStore client of ``endpoint``; ``StoreUnreachable`` when nothing listens or it does not answer in time."""
    from torch.distributed import TCPStore

    if not port_accepts(endpoint.host, endpoint.port, connect_s=TCP_CONNECT_TIMEOUT_S):
        raise StoreUnreachable(f"{endpoint.describe()}: nothing listens")
    try:
        return bounded(lambda: TCPStore(endpoint.host, endpoint.port, None, is_master=False,
                                        timeout=timedelta(seconds=timeout_s), wait_for_workers=False),
                       timeout_s + TCP_CONNECT_TIMEOUT_S, endpoint.describe())
    except (TimeoutError, RuntimeError) as exc:   # it listens: frozen, reset, or slower than timeout_s
        raise StoreSlow(f"{endpoint.describe()}: {exc}") from exc


def read_sealed(store, keys: GroupKeys, key: str, where: str) -> bytes | None:
    full = keys.full(key)
    return keys.open(key, bytes(store.get(full)), where) if store.check([full]) else None


def read_active(store, keys: GroupKeys, where: str) -> ActiveStore | None:
    """The store's ``active`` entry when the group has formed there, else ``None``."""
    if read_sealed(store, keys, FORMED_KEY, where) is None:
        return None
    raw = read_sealed(store, keys, ACTIVE_KEY, where)
    return None if raw is None else ActiveStore.decode(raw)


def mark_formed(store, keys: GroupKeys, active: ActiveStore) -> ActiveStore:
    """Claim ``active`` (compare-and-set on the absent key), then set ``formed``; returns the ``active`` that won."""
    won = store.compare_set(keys.full(ACTIVE_KEY), "", keys.seal(ACTIVE_KEY, active.encode()))
    winner = ActiveStore.decode(keys.open(ACTIVE_KEY, bytes(won), "the store"))
    store.set(keys.full(FORMED_KEY), keys.seal(FORMED_KEY, b"1"))
    return winner


def find_active(endpoints: Sequence[Endpoint], keys: GroupKeys, *, timeout_s: float = PROBE_TIMEOUT_S,
                newer_than: int = -1) -> Found | None:
    """The formed store of the highest generation (above ``newer_than``) among ``endpoints``, probed in parallel and
    bounded; ``None`` when none answers as one. A store whose entries fail the token check is skipped (logged)."""
    found: list[Found] = []
    lock = threading.Lock()

    def probe(ep: Endpoint) -> None:
        try:
            store = connect(ep, timeout_s=timeout_s)
            active = bounded(lambda: read_active(store, keys, ep.describe()), timeout_s, ep.describe())
        except (StoreUnreachable, TimeoutError):
            return
        except RendezvousError as exc:
            log.warning("ignoring %s: %s", ep.describe(), exc)
            return
        if active is not None and active.generation > newer_than:
            with lock:
                found.append(Found(store, ep, active))

    threads = [threading.Thread(target=probe, args=(ep,), name="dwdp-store-search", daemon=True) for ep in endpoints]
    for t in threads:
        t.start()
    deadline = 2 * timeout_s + 2 * TCP_CONNECT_TIMEOUT_S
    for t in threads:
        t.join(deadline)
    with lock:
        best = max(found, key=lambda f: f.active.generation, default=None)
    return best


def promote_successor(candidates: Sequence[Endpoint], keys: GroupKeys, *, generation: int,
                      timeout_s: float = PROBE_TIMEOUT_S, patient_s: float = PATIENT_PROBE_TIMEOUT_S) -> Found:
    """The failover: the first candidate whose standby answers becomes the store of ``generation`` (or already is,
    promoted by a faster survivor; or is newer still, promoted by a later failover this rank missed). Candidates
    that listen but did not answer within ``timeout_s`` are tried once more, in the same order, within
    ``patient_s`` (``PATIENT_PROBE_TIMEOUT_S``), when no candidate answered at all. Raises ``StoreUnreachable``
    naming every candidate tried."""
    tried: list[str] = []
    slow: list[Endpoint] = []
    for ep in candidates:
        found = _promote(ep, keys, generation, timeout_s, tried, slow)
        if found is not None:
            return found
    for ep in slow if patient_s > timeout_s else ():
        log.warning("no standby store answered within %g s for generation %d: trying %s again within %g s",
                    timeout_s, generation, ep.describe(), patient_s)
        found = _promote(ep, keys, generation, patient_s, tried, None)
        if found is not None:
            return found
    raise StoreUnreachable(f"no standby store answered for generation {generation}: " + "; ".join(tried or ["none"]))


def _promote(ep: Endpoint, keys: GroupKeys, generation: int, timeout_s: float, tried: list[str],
             slow: list[Endpoint] | None) -> Found | None:
    """One candidate of ``promote_successor``: its ``Found``, or None with why in ``tried`` (and the endpoint in
    ``slow`` when it listens but did not answer in time)."""
    try:
        store = connect(ep, timeout_s=timeout_s)
        won = bounded(lambda: mark_formed(store, keys, ActiveStore(generation, ep.rank)), timeout_s, ep.describe())
    except (StoreSlow, TimeoutError) as exc:
        tried.append(f"{ep.describe()}: {exc}")
        if slow is not None:
            slow.append(ep)
        return None
    except (StoreUnreachable, RendezvousError) as exc:
        tried.append(f"{ep.describe()}: {exc}")
        return None
    if won.generation < generation:
        tried.append(f"{ep.describe()}: already the store of the older generation {won.generation}")
        return None
    return Found(store, ep, won)


class StandbyStore:
    """This rank's standby store: a TCPStore server on its standby port, empty until a failover promotes it.
    ``close()`` is idempotent; the server also ends with the process."""

    def __init__(self, port: int):
        from torch.distributed import TCPStore

        self.port = port
        try:
            self._server = TCPStore("0.0.0.0", port, None, is_master=True, timeout=timedelta(seconds=30),
                                    wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - rewrap with the fix
            raise RendezvousError(f"could not host this rank's standby store on port {port} ({exc}): the port "
                                  f"must be free (an elastic group uses store port + 1 + rank on every rank's host)"
                                  ) from exc

    def close(self) -> None:
        self._server = None
