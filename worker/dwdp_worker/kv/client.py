"""Reference decode client: pull a context server's KV over NIXL, continue greedy decoding with plain `transformers`.

    from dwdp_worker.kv.client import KvPuller, decode_from_params
    with KvPuller() as puller:
        pulled = puller.pull(params)                       # params: the response's kv_transfer_params
        tokens, _ = decode_from_params(model, prompt_ids, first_token, pulled, max_new_tokens=16)

CLI (a whole router flow in one command: prefill on the DWDP server, decode here)::

    python -m dwdp_worker.kv.client --url http://127.0.0.1:8000 --model DIR --prompt-ids 5,17,42 --max-new-tokens 16

A pull (docs/KV_TRANSFER.md, protocol ``dwdp-kv/2``), each step bounded:

  1. ``claim``: load the prefill agent's metadata from the params → CLAIM (with this agent's metadata and
     the protocol) → CLAIMED (a lease of ``lease_s`` seconds) or REFUSED(reason);
  2. ``read``: one NIXL READ of the blocks (one descriptor per run of consecutive blocks) carrying PULLED
     as its notification — skipped, with an error, when this process's own monotonic clock shows the lease
     is over for certain (more than ``lease_s`` since CLAIMED arrived: the rank's lease began earlier);
  3. ``await_verdict``: the rank's answer to PULLED — RELEASED (valid: use the bytes) or STALE(reason),
     within ``VERDICT_TIMEOUT_S``. Stale or no answer is a ``KvPullError`` and the bytes are dropped.

Nothing here reads the wall clock: ``lease_until``/``expires_at`` are the server's unix times and a decode
host's clock may be off; durations measured on this host's monotonic clock and the rank's verdict decide.
An unknown/expired request, a restarted or dead group, a lost connection, a lapsed lease or a READ that
may have raced a free is a ``KvPullError`` naming the cause: never a hang, never wrong KV used.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from .blocks import runs
from .layout import read_stream
from .nixl_api import b64, new_agent, unb64
from .params import PROTOCOL, AgentMessage, AgentOp, KvTransferParams, MemKind

#: bound on the claim round trip (the prefill rank answers within a few poll periods when alive)
CLAIM_TIMEOUT_S = 10.0
#: bound on one READ (a lease is 30 s by default: a READ confirmed after it is answered stale anyway)
READ_TIMEOUT_S = 30.0
#: bound on the verdict after a READ (a few poll periods when the rank is alive); silence counts as stale
VERDICT_TIMEOUT_S = 10.0
#: unread notifications kept per context rank (answers to pulls this client stopped waiting for)
INBOX_MAX = 256
_POLL_S = 0.0005


class KvPullError(RuntimeError):
    """The KV could not be pulled or must not be used (the message says why: unknown, expired, unreachable,
    failed READ, lapsed lease, stale verdict, no verdict)."""


@dataclass
class Claim:
    """One claimed pull: the lease the rank granted, timed on this host's monotonic clock."""

    params: KvTransferParams
    remote: str
    nonce: str
    lease_s: float      # as the rank answered: lease left when it replied
    t_sent: float       # monotonic: CLAIM sent
    t_claimed: float    # monotonic: CLAIMED received
    lease_until: float = 0.0  # the rank's unix time of the lease's end: informational, never used here

    def surely_lapsed(self, now: float | None = None) -> bool:
        """True once the rank's lease is over whatever its clock says: it began before CLAIMED left the rank."""
        return (time.monotonic() if now is None else now) > self.t_claimed + self.lease_s


@dataclass
class PulledKv:
    params: KvTransferParams
    kv: list[tuple[Any, Any]]   # per layer (key, value), [1, heads, seq_len, dim], on the puller's device
    nbytes: int
    claim_s: float              # CLAIM → CLAIMED
    read_s: float               # READ posted → DONE
    register_s: float = 0.0     # destination buffer allocated and registered (a real engine does this once)
    verdict_s: float = 0.0      # DONE → RELEASED

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9 if self.read_s > 0 else float("inf")


def parse_params(params: KvTransferParams | dict) -> KvTransferParams:
    """The params as a model; a ``KvPullError`` naming the mismatch for another protocol or a bad field."""
    if isinstance(params, KvTransferParams):
        return params
    spoken = params.get("protocol") if isinstance(params, dict) else None
    if spoken != PROTOCOL:
        raise KvPullError(f"kv_transfer_params speak {spoken!r}; this client speaks {PROTOCOL!r}")
    try:
        return KvTransferParams.model_validate(params)
    except ValueError as exc:
        raise KvPullError(f"bad kv_transfer_params: {exc}") from None


class KvPuller:
    """A decode-side NIXL agent (one per decode process; reusable for any number of pulls)."""

    def __init__(self, *, name: str | None = None, device="cpu"):
        import torch

        self.device = torch.device(device)
        self.name = name or f"dwdp-decode-{uuid.uuid4().hex[:12]}"
        self._agent = new_agent(self.name)
        self._metadata = b64(self._agent.get_agent_metadata())
        self._remotes: set[str] = set()
        self._inbox: dict[str, list[bytes]] = {}

    def _connect(self, params: KvTransferParams) -> str:
        if params.remote_engine_id in self._remotes:
            return params.remote_engine_id
        try:
            name = self._agent.add_remote_agent(unb64(params.remote_agent_metadata))
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own types
            raise KvPullError(f"context rank {params.remote_engine_id} unreachable (its agent is gone: the rank "
                              f"died or the group restarted, or the metadata is bad): {exc}") from exc
        name = name.decode() if isinstance(name, bytes) else name
        if name != params.remote_engine_id:
            self._agent.remove_remote_agent(name)
            raise KvPullError(f"agent metadata names {name!r}, params name {params.remote_engine_id!r}")
        self._remotes.add(name)
        return name

    def _disconnect(self, remote: str) -> None:
        if remote in self._remotes:
            self._remotes.discard(remote)
            try:
                self._agent.remove_remote_agent(remote)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def send(self, remote: str, msg: AgentMessage) -> None:
        self._agent.send_notif(remote, msg.encode())

    def _await(self, remote: str, nonce: str, ops: tuple[AgentOp, ...], deadline: float) -> AgentMessage | None:
        """The first message from ``remote`` for ``nonce`` with one of ``ops``, or None at ``deadline``."""
        while True:
            for sender, msgs in self._agent.get_new_notifs().items():
                box = self._inbox.setdefault(sender, [])
                box.extend(msgs)
                del box[:-INBOX_MAX]
            box = self._inbox.get(remote, [])
            for i, raw in enumerate(box):
                try:
                    msg = AgentMessage.decode(raw)
                except ValueError:
                    continue
                if msg.nonce == nonce and msg.op in ops:
                    del box[i]
                    return msg
            if time.monotonic() >= deadline:
                return None
            time.sleep(_POLL_S)

    # -- the three steps of a pull (``pull`` runs them; a decode engine may run them itself) -----------------
    def claim(self, params: KvTransferParams | dict, *, timeout_s: float = CLAIM_TIMEOUT_S) -> Claim:
        params = parse_params(params)
        remote = self._connect(params)
        nonce = uuid.uuid4().hex
        t0 = time.monotonic()
        msg = AgentMessage(op=AgentOp.CLAIM, request_id=params.request_id, nonce=nonce, protocol=PROTOCOL,
                           metadata=self._metadata)
        try:
            self.send(remote, msg)
            reply = self._await(remote, nonce, (AgentOp.CLAIMED, AgentOp.REFUSED), t0 + timeout_s)
        except Exception as exc:  # noqa: BLE001 - NIXL/UCX connection errors
            self._disconnect(remote)
            raise KvPullError(f"context rank {remote} unreachable: {exc}") from exc
        if reply is None:
            self._disconnect(remote)
            raise KvPullError(f"no answer from context rank {remote} within {timeout_s:g} s: it is gone, restarted "
                              "(a new group start has new engine ids) or unreachable")
        if reply.op is AgentOp.REFUSED:
            raise KvPullError(f"context rank {remote} refused request {params.request_id}: {reply.reason}")
        if not reply.lease_s or reply.lease_s <= 0:
            raise KvPullError(f"context rank {remote} claimed request {params.request_id} without a lease")
        return Claim(params=params, remote=remote, nonce=nonce, lease_s=reply.lease_s, t_sent=t0,
                     t_claimed=time.monotonic(), lease_until=reply.lease_until or 0.0)

    def read(self, claim: Claim, *, timeout_s: float = READ_TIMEOUT_S):
        """One READ of the claimed blocks, ``pulled`` as its notification → (flat uint8 buffer, register_s,
        read_s). A failed or timed-out READ aborts the claim. The bytes are not to be used before
        ``await_verdict`` returns."""
        import torch

        params, remote = claim.params, claim.remote
        region = params.region
        bb = region.block_bytes
        t0 = time.monotonic()
        dst = torch.empty(len(params.remote_block_ids) * bb, dtype=torch.uint8, device=self.device)
        local_mem = "VRAM" if self.device.type == "cuda" else "DRAM"
        local_dev = self.device.index or 0
        local, remote_descs, pos = [], [], 0
        for first, count in runs(params.remote_block_ids):
            local.append((dst.data_ptr() + pos, count * bb, local_dev))
            remote_descs.append((region.base_addr + first * bb, count * bb, region.device_id))
            pos += count * bb
        reg = self._agent.register_memory([dst])
        handle = None
        pulled = AgentMessage(op=AgentOp.PULLED, request_id=params.request_id, nonce=claim.nonce).encode()
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, local_mem),
                self._agent.get_xfer_descs(remote_descs, MemKind(region.mem).value), remote, pulled)
            t_post = time.monotonic()
            state = self._agent.transfer(handle)
            deadline = t_post + timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KvPullError(f"READ of request {params.request_id} from {remote} "
                                  f"{'timed out' if state == 'PROC' else 'failed'} ({state})")
            t_done = time.monotonic()
        except KvPullError:
            self.abort(claim)
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL errors (e.g. the remote agent vanished)
            self.abort(claim)
            raise KvPullError(f"READ of request {params.request_id} from {remote} failed: {exc}") from exc
        finally:
            if handle is not None:
                handle.release()
            self._agent.deregister_memory(reg)
        return dst, t_post - t0, t_done - t_post

    def await_verdict(self, claim: Claim, *, timeout_s: float = VERDICT_TIMEOUT_S) -> float:
        """Wait for the rank's verdict on this claim's READ; the seconds it took. ``KvPullError`` unless valid."""
        t0 = time.monotonic()
        rid = claim.params.request_id
        reply = self._await(claim.remote, claim.nonce, (AgentOp.RELEASED, AgentOp.STALE), t0 + timeout_s)
        if reply is None:
            raise KvPullError(f"no verdict from context rank {claim.remote} on request {rid} within {timeout_s:g} s "
                              "after the READ: what was read cannot be trusted and was discarded")
        if reply.op is not AgentOp.RELEASED or reply.valid is not True:
            raise KvPullError(f"context rank {claim.remote} answered stale for request {rid}: {reply.reason}; "
                              "what was read was discarded (prefill again)")
        return time.monotonic() - t0

    def abort(self, claim: Claim) -> None:
        try:
            self.send(claim.remote, AgentMessage(op=AgentOp.ABORT, request_id=claim.params.request_id,
                                                 nonce=claim.nonce))
        except Exception:  # noqa: BLE001 - the remote may be gone; its lease frees the KV anyway
            pass
        self._disconnect(claim.remote)

    def pull(self, params: KvTransferParams | dict, *, claim_timeout_s: float = CLAIM_TIMEOUT_S,
             read_timeout_s: float = READ_TIMEOUT_S, verdict_timeout_s: float = VERDICT_TIMEOUT_S,
             after_claim=None) -> PulledKv:
        """Claim, READ, wait for the verdict. ``after_claim()`` (fault-injection tests) runs between CLAIMED and
        the READ."""
        claim = self.claim(params, timeout_s=claim_timeout_s)
        if after_claim is not None:
            after_claim()
        if claim.surely_lapsed():
            waited = time.monotonic() - claim.t_claimed
            raise KvPullError(f"the {claim.lease_s:g} s lease on request {claim.params.request_id} lapsed before the "
                              f"READ could start ({waited:.3g} s after the claim, on this host's clock): not read; "
                              "prefill again")
        dst, register_s, read_s = self.read(claim, timeout_s=read_timeout_s)
        verdict_s = self.await_verdict(claim, timeout_s=verdict_timeout_s)
        params = claim.params
        kv = read_stream(dst[:params.stream_bytes], params.tensors)
        return PulledKv(params=params, kv=kv, nbytes=params.stream_bytes, claim_s=claim.t_claimed - claim.t_sent,
                        read_s=read_s, register_s=register_s, verdict_s=verdict_s)

    def close(self) -> None:
        for remote in list(self._remotes):
            self._disconnect(remote)
        self._agent = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def decode_from_params(model, prompt: Sequence[int], first_token: int, pulled: PulledKv, *, max_new_tokens: int):
    """Greedy tokens (``max_new_tokens``, starting with ``first_token``) decoded by ``model`` from the pulled KV."""
    from .prefill import cache_from, continue_greedy

    if len(prompt) != pulled.params.seq_len:
        raise ValueError(f"the prompt has {len(prompt)} tokens, the pulled KV {pulled.params.seq_len}")
    return continue_greedy(model, prompt, first_token, cache_from(model, pulled.kv), max_new_tokens)


# -- CLI ---------------------------------------------------------------------------------------------------
def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dwdp_worker.kv.client", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the DWDP context server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="checkpoint directory the decode side loads (plain transformers)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (the server tokenizes it)")
    src.add_argument("--prompt-ids", help="comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=16, help="greedy tokens to decode, the first one included "
                                                                  "(default 16)")
    p.add_argument("--device", default="cpu", help="where the pulled KV lands and the model decodes (cpu, cuda:0)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="bound on the prefill request (default 60)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    args = _parse_args(argv)
    prompt: Any = args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.split(",")]
    # a decode engine is up (model loaded, agent created) before a request comes: the pull is then all that
    # runs between the prefill's answer and the TTL
    model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    try:
        with KvPuller(device=args.device) as puller:
            r = httpx.post(args.url.rstrip("/") + "/v1/completions", json=body, timeout=args.timeout_s)
            if r.status_code != 200:
                print(f"prefill failed: HTTP {r.status_code}: {r.text}", file=sys.stderr)
                return 1
            choice = r.json()["choices"][0]
            params = parse_params(choice["kv_transfer_params"])
            prompt_ids = params.prompt_token_ids or prompt  # the server's tokenization of a text prompt
            pulled = puller.pull(params)
    except KvPullError as exc:
        print(f"pull failed: {exc}", file=sys.stderr)
        return 1
    with torch.inference_mode():
        tokens, _ = decode_from_params(model, prompt_ids, choice["token_ids"][0], pulled,
                                       max_new_tokens=args.max_new_tokens)
    print(json.dumps({"tokens": tokens, "pulled_bytes": pulled.nbytes, "claim_s": round(pulled.claim_s, 6),
                      "register_s": round(pulled.register_s, 6), "read_s": round(pulled.read_s, 6),
                      "verdict_s": round(pulled.verdict_s, 6), "read_gbps": round(pulled.read_gbps, 6),
                      "engine": params.remote_engine_id, "dwdp_rank": params.dwdp_rank,
                      "remote_host": params.remote_host, "remote_port": params.remote_port}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
