"""The prefill rank's KV service: its region registered once with its own NIXL agent, and the thread
that answers decode agents (claim → claimed/refused; the READ's ``pulled`` → the verdict, released/stale).

A decode agent loads ``remote_agent_metadata`` from the response, sends ``CLAIM`` (with its own
metadata, so this agent can answer — no listener port, no side channel), waits for ``CLAIMED``, READs
the blocks with ``PULLED`` as the transfer's notification (NIXL delivers it after the data), and this
side answers that notification with the store's verdict (``KvStore.confirm``): ``RELEASED`` (valid: the
blocks were held for that claim throughout, now freed) or ``STALE`` with the reason. See
docs/KV_TRANSFER.md.

Invariants:
  * After ``__init__`` only the service thread touches the NIXL agent (it also progresses UCX for the
    agent: the agent has no progress thread, ``nixl_api``); ``close`` stops the thread, then
    deregisters the region, then drops the agent.
  * Every ``pulled`` from a loaded agent gets exactly one verdict. One from an agent this rank never
    loaded (it never claimed) cannot be answered (there is no address to answer to): the decode side's
    bounded wait for a verdict fails, which it must treat as stale.
  * A claim that does not name ``params.PROTOCOL`` is refused with the reason, in fields a ``dwdp-kv/1``
    consumer decodes; it never gets a lease.
  * A remote agent is loaded for the first claim it sends and unloaded once it holds no claim and has
    been idle ``PEER_IDLE_S`` since its last message or since the grace period after its last claim's end
    (a lapse included), so a late ``pulled`` still reaches a loaded peer and gets its stale verdict.
  * A malformed notification is logged and dropped; it never stops the thread.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from .nixl_api import b64, new_agent, unb64
from .params import PROTOCOL, AgentMessage, AgentOp
from .store import KvStore

log = logging.getLogger(__name__)

#: notification poll period when idle: a claim's round trip is ~2 polls; measured idle cost at 2 ms: ~2 % of a core
POLL_S = 0.002
#: poll period while a pull is under way (a claim held, or a notification within ``ACTIVE_WINDOW_S``): the
#: verdict a decode side waits for after its READ comes within ~0.2 ms instead of ~2 (measured on H200: the
#: verdict was 2.3–2.9 ms of a 32 MiB pull whose READ took 0.7–1.6 ms); the fast polls last only as long as
#: the pull, so the idle cost stays POLL_S's
FAST_POLL_S = 0.0002
#: how long after a notification the service keeps polling fast (a decode engine pulls sequences in bursts)
ACTIVE_WINDOW_S = 0.05
#: TTL sweep period (expiry is checked at claim time too, so this only bounds how long freed memory waits)
SWEEP_S = 0.05
#: a decode agent with no claim left is disconnected after this idle time (a reply still in flight
#: when it was unloaded would be lost; a decode engine that pulls again reconnects)
PEER_IDLE_S = 5.0


def poll_period(pull_under_way: bool, since_last_notif_s: float) -> float:
    """The service's next wait: fast while a claim is held or a notification just came, else the idle period."""
    return FAST_POLL_S if pull_under_way or since_last_notif_s < ACTIVE_WINDOW_S else POLL_S


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
        last_notif = float("-inf")
        while not self._stop.is_set():
            try:
                for sender, msgs in self._agent.get_new_notifs().items():
                    for raw in msgs:
                        self._handle(sender, raw)
                    last_notif = time.monotonic()
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + SWEEP_S
                    for rid in self.store.sweep():
                        log.info("KV of %s expired unclaimed (or its pull lease lapsed): freed", rid)
                    self._drop_idle_peers(now)
            except Exception:  # noqa: BLE001 - the service must outlive any one bad message
                log.exception("KV service loop")
            self._stop.wait(poll_period(any(self._claims.values()), time.monotonic() - last_notif))

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
        elif msg.op is AgentOp.PULLED:
            self._verdict(sender, msg)
        elif msg.op is AgentOp.ABORT:
            self.store.abort(msg.request_id, sender, msg.nonce)
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
        if msg.protocol != PROTOCOL:
            reply = AgentMessage(op=AgentOp.REFUSED, request_id=msg.request_id, nonce=msg.nonce,
                                 reason=f"protocol {msg.protocol or 'dwdp-kv/1 (no protocol field)'} is not served: "
                                        f"this context server speaks {PROTOCOL}, where a decode side must wait "
                                        "for the rank's verdict (released/stale) after each READ before using "
                                        "the KV (docs/KV_TRANSFER.md); upgrade the consumer")
            self._agent.send_notif(sender, reply.encode())
            return
        res = self.store.claim(msg.request_id, sender, msg.nonce)
        if res.entry is None:
            reply = AgentMessage(op=AgentOp.REFUSED, request_id=msg.request_id, nonce=msg.nonce,
                                 reason=str(res.refusal))
        else:
            self._claims.setdefault(sender, set()).add(msg.request_id)
            reply = AgentMessage(op=AgentOp.CLAIMED, request_id=msg.request_id, nonce=msg.nonce,
                                 lease_s=res.lease_s, lease_until=res.lease_until)
        self._agent.send_notif(sender, reply.encode())

    def _verdict(self, sender: str, msg: AgentMessage) -> None:
        verdict = self.store.confirm(msg.request_id, sender, msg.nonce)
        if verdict.valid:
            self._claims.get(sender, set()).discard(msg.request_id)
            reply = AgentMessage(op=AgentOp.RELEASED, request_id=msg.request_id, nonce=msg.nonce, valid=True)
        else:
            log.info("stale pull of %s by %s: %s", msg.request_id, sender, verdict.stale)
            reply = AgentMessage(op=AgentOp.STALE, request_id=msg.request_id, nonce=msg.nonce, valid=False,
                                 reason=str(verdict.stale))
        if sender not in self._peers:
            log.warning("pulled of %s from %s, an agent that never claimed here: no verdict can be sent",
                        msg.request_id, sender)
            return
        self._agent.send_notif(sender, reply.encode())

    def _drop_idle_peers(self, now: float) -> None:
        for peer, last in list(self._peers.items()):
            before = self._claims.get(peer, set())
            held = {r for r in before if self.store.get(r) is not None}
            self._claims[peer] = held
            if held != before:
                # a claim ended (lapsed, aborted): its late `pulled` must find the peer. The blocks wait out the
                # grace first, so the READ that can see another request's bytes comes only after it: the idle
                # clock starts at the grace's end (with the grace at 5 s, a READ just after it found the peer
                # dropped and got no verdict)
                self._peers[peer] = last = now + self.store.grace_s
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
