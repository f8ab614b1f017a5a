"""One rank's KV handoff, assembled: region (registered once) + bounded store + NIXL service thread.

``KvService.start(settings, device=…, engine_id=…)`` allocates the region on the rank's device,
registers it with a new NIXL agent and starts answering decode agents. ``keep(request_id, kv, seq_len)``
copies one sequence's K/V into the region and returns the ``KvTransferParams`` for the response (the
front fills in ``model``, ``remote_host``/``remote_port``: only it knows the address it serves on).
``close`` is idempotent.
"""

from __future__ import annotations

from dataclasses import dataclass

from .params import KvTransferParams
from .region import DEFAULT_BLOCK_BYTES, KvRegion
from .server import KvServer
from .store import DEFAULT_GRACE_S, DEFAULT_LEASE_S, DEFAULT_TTL_S, KvStats, KvStore


@dataclass(frozen=True)
class KvSettings:
    """The KV handoff knobs of one rank (flags / env contract; budget 0 = off)."""

    budget_bytes: int = 0
    block_bytes: int = DEFAULT_BLOCK_BYTES
    ttl_s: float = DEFAULT_TTL_S
    lease_s: float = DEFAULT_LEASE_S
    grace_s: float = DEFAULT_GRACE_S   # blocks freed by a lapsed lease or an abort wait this long before reuse

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0


@dataclass(frozen=True)
class RankIdentity:
    job: str = "dwdp"
    group: int = 0
    rank: int = 0
    attempt: int = 0


class KvService:
    def __init__(self, store: KvStore, server: KvServer, identity: RankIdentity):
        self.store, self.server, self.identity = store, server, identity
        self._region_desc = store.region.describe()
        self._closed = False

    @classmethod
    def start(cls, settings: KvSettings, *, device, identity: RankIdentity, **server_kw) -> "KvService":
        from .server import engine_id

        region = KvRegion(settings.budget_bytes, block_bytes=settings.block_bytes, device=device)
        store = KvStore(region, ttl_s=settings.ttl_s, lease_s=settings.lease_s, grace_s=settings.grace_s)
        name = engine_id(job=identity.job, group=identity.group, rank=identity.rank, attempt=identity.attempt)
        return cls(store, KvServer(store, name=name, **server_kw), identity)

    @property
    def engine_id(self) -> str:
        return self.server.name

    def keep(self, request_id: str, kv, seq_len: int, *, model: str = "") -> KvTransferParams:
        """Store one sequence's KV (``KvBudgetFull`` when there is no room) → its transfer params."""
        e = self.store.put(request_id, kv, seq_len)
        return KvTransferParams(remote_engine_id=self.server.name, remote_block_ids=e.block_ids,
                                remote_agent_metadata=self.server.metadata, region=self._region_desc,
                                tensors=e.descs, stream_bytes=e.stream_bytes, seq_len=seq_len, model=model,
                                dwdp_group=self.identity.group, dwdp_rank=self.identity.rank,
                                request_id=request_id, expires_at=e.expires_at, ttl_s=self.store.ttl_s,
                                lease_s=self.store.lease_s)

    def stats(self) -> KvStats:
        return self.store.stats()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.server.close()          # deregisters the region first …
            self.store.region.close()    # … then frees it
