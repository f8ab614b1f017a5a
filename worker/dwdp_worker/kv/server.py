"""The prefill rank's KV service: its region registered once with its own NIXL agent, and the thread
that answers decode agents (claim → claimed/refused; the READ's completion notification frees).

A decode agent loads ``remote_agent_metadata`` from the response, sends ``CLAIM`` (with its own
metadata, so this agent can answer — no listener port, no side channel), waits for ``CLAIMED``, READs
the blocks with ``PULLED`` as the transfer's notification (NIXL delivers it after the data), and this
side frees the blocks on that notification. See docs/KV_TRANSFER.md.

Invariants:
  * After ``__init__`` only the service thread touches the NIXL agent (it also progresses UCX for the
    agent: the agent has no progress thread, ``nixl_api``); ``close`` stops the thread, then
    deregisters the region, then drops the agent.
  * A remote agent is loaded for the first claim it sends and unloaded once it holds no claim and has
    been idle ``PEER_IDLE_S`` (bounded connections across any number of decode clients).
  * A malformed notification is logged and dropped; it never stops the thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from .nixl_api import b64, new_agent, unb64
from .params import AgentMessage, AgentOp
from .store import KvStore

log = logging.getLogger(__name__)

#: notification poll period: a claim's round trip is ~2 polls; measured idle cost at 2 ms: ~2 % of a core
POLL_S = 0.002
#: TTL sweep period (expiry is checked at claim time too, so this only bounds how long freed memory waits)
SWEEP_S = 0.05
#: a decode agent with no claim left is disconnected after this idle time (a reply still in flight
#: when it was unloaded would be lost; a decode engine that pulls again reconnects)
PEER_IDLE_S = 5.0


def engine_id(*, job: str, group: int, rank: int, attempt: int) -> str:
    """A NIXL agent name unique per rank *and start*: a pull aimed at a restarted group names an agent
    that no longer exists and fails at claim time instead of reading someone else's KV."""
    return f"dwdp-{job}-g{group}-r{rank}-a{attempt}-{uuid.uuid4().hex[:8]}"


class KvServer:
    def __init__(self, store: KvStore, *, name: str, peer_idle_s: float = PEER_IDLE_S):
        self.store = store
        self.name = name
        self.peer_idle_s = peer_idle_s
        self._agent = new_agent(name)
        self._reg = self._agent.register_memory([store.region.buffer])
        self.metadata = b64(self._agent.get_agent_metadata())
        self._peers: dict[str, float] = {}         # loaded remote agent → last activity (monotonic)
        self._claims: dict[str, set[str]] = {}     # remote agent → request ids it holds claimed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-{name}", daemon=True)
        self._thread.start()

    # -- service thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_sweep = 0.0
        while not self._stop.is_set():
            try:
                for sender, msgs in self._agent.get_new_notifs().items():
                    for raw in msgs:
                        self._handle(sender, raw)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    for rid in self.store.sweep():
                        log.info("KV of %s expired unclaimed (or its pull lease lapsed): freed", rid)
                    self._drop_idle_peers(now)
            except Exception:  # noqa: BLE001 - the service must outlive any one bad message
                log.exception("KV service loop")
            self._stop.wait(POLL_S)

    def _handle(self, sender: str, raw: bytes) -> None:
        try:
            msg = AgentMessage.decode(raw)
        except ValueError as exc:
            log.warning("malformed KV notification from %s dropped: %s", sender, exc)
            return
        if sender in self._peers:
            self._peers[sender] = time.monotonic()
        if msg.op is AgentOp.CLAIM:
            self._claim(sender, msg)
        elif msg.op in (AgentOp.PULLED, AgentOp.ABORT):
            self.store.release(msg.request_id, claimer=sender, nonce=msg.nonce, pulled=msg.op is AgentOp.PULLED)
            self._claims.get(sender, set()).discard(msg.request_id)
        else:
            log.warning("unexpected KV notification %s from %s dropped", msg.op, sender)

    def _claim(self, sender: str, msg: AgentMessage) -> None:
        if sender not in self._peers:
            if not msg.metadata:
                log.warning("claim from %s without agent metadata dropped", sender)
                return
            loaded = self._agent.add_remote_agent(unb64(msg.metadata))
            if isinstance(loaded, bytes):
                loaded = loaded.decode()
            if loaded != sender:
                log.warning("claim from %s carried metadata of %s: dropped", sender, loaded)
                self._agent.remove_remote_agent(loaded)
                return
        self._peers[sender] = time.monotonic()
        res = self.store.claim(msg.request_id, sender, msg.nonce)
        if res.entry is None:
            reply = AgentMessage(op=AgentOp.REFUSED, request_id=msg.request_id, nonce=msg.nonce,
                                 reason=str(res.refusal))
        else:
            self._claims.setdefault(sender, set()).add(msg.request_id)
            reply = AgentMessage(op=AgentOp.CLAIMED, request_id=msg.request_id, nonce=msg.nonce,
                                 lease_until=res.lease_until)
        self._agent.send_notif(sender, reply.encode())

    def _drop_idle_peers(self, now: float) -> None:
        for peer, last in list(self._peers.items()):
            held = {r for r in self._claims.get(peer, set()) if self.store.get(r) is not None}
            self._claims[peer] = held
            if not held and now - last >= self.peer_idle_s:
                self._agent.remove_remote_agent(peer)
                del self._peers[peer]
                self._claims.pop(peer, None)

    # -- lifecycle -------------------------------------------------------------------------------------------
    @property
    def num_peers(self) -> int:
        return len(self._peers)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        for peer in list(self._peers):
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        self._peers.clear()
        self._agent.deregister_memory(self._reg)
        self._agent = None
