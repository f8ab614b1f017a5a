"""Reference decode client: pull a context server's KV over NIXL, continue greedy decoding with plain `transformers`.

    from dwdp_worker.kv.client import KvPuller, decode_from_params
    with KvPuller() as puller:
        pulled = puller.pull(params)                       # params: the response's kv_transfer_params
        tokens, _ = decode_from_params(model, prompt_ids, first_token, pulled, max_new_tokens=16)

CLI (a whole router flow in one command: prefill on the DWDP server, decode here)::

    python -m dwdp_worker.kv.client --url http://127.0.0.1:8000 --model DIR --prompt-ids 5,17,42 --max-new-tokens 16

A pull (docs/KV_TRANSFER.md): load the prefill agent's metadata from the params → CLAIM (with this
agent's metadata) → CLAIMED or REFUSED(reason) → one NIXL READ of the blocks (one descriptor per run
of consecutive blocks) carrying PULLED as its notification, on which the prefill rank frees them.
Every wait is bounded: an unknown/expired request, a restarted or dead group, or a lost connection is
a ``KvPullError`` naming the cause, never a hang and never silently wrong KV (the lease guarantees the
blocks are not reused while the READ runs).
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
from .params import AgentMessage, AgentOp, KvTransferParams, MemKind

#: bound on the claim round trip (the prefill rank answers within a few poll periods when alive)
CLAIM_TIMEOUT_S = 10.0
#: bound on one READ (a lease is 30 s by default: the prefill rank frees leased KV after that)
READ_TIMEOUT_S = 30.0
_POLL_S = 0.0005


class KvPullError(RuntimeError):
    """The KV could not be pulled (the message says why: unknown, expired, unreachable, failed READ)."""


@dataclass
class PulledKv:
    params: KvTransferParams
    kv: list[tuple[Any, Any]]   # per layer (key, value), [1, heads, seq_len, dim], on the puller's device
    nbytes: int
    claim_s: float              # CLAIM → CLAIMED
    read_s: float               # READ posted → DONE

    @property
    def read_gbps(self) -> float:
        return self.nbytes / self.read_s / 1e9 if self.read_s > 0 else float("inf")


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

    def _await_reply(self, remote: str, nonce: str, deadline: float) -> AgentMessage:
        while time.monotonic() < deadline:
            for sender, msgs in self._agent.get_new_notifs().items():
                self._inbox.setdefault(sender, []).extend(msgs)
            box = self._inbox.get(remote, [])
            for i, raw in enumerate(box):
                try:
                    msg = AgentMessage.decode(raw)
                except ValueError:
                    continue
                if msg.nonce == nonce:
                    del box[i]
                    return msg
            time.sleep(_POLL_S)
        raise KvPullError(f"no answer from context rank {remote} within {CLAIM_TIMEOUT_S:g} s: it is gone, "
                          "restarted (a new group start has new engine ids) or unreachable")

    def pull(self, params: KvTransferParams | dict, *, claim_timeout_s: float = CLAIM_TIMEOUT_S,
             read_timeout_s: float = READ_TIMEOUT_S, after_claim=None) -> PulledKv:
        """Claim, READ, confirm. ``after_claim()`` (fault-injection tests) runs between CLAIMED and the READ."""
        import torch

        if not isinstance(params, KvTransferParams):
            params = KvTransferParams.model_validate(params)
        remote = self._connect(params)
        nonce = uuid.uuid4().hex
        t0 = time.monotonic()
        claim = AgentMessage(op=AgentOp.CLAIM, request_id=params.request_id, nonce=nonce, metadata=self._metadata)
        try:
            self._agent.send_notif(remote, claim.encode())
            reply = self._await_reply(remote, nonce, t0 + claim_timeout_s)
        except KvPullError:
            self._disconnect(remote)
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL/UCX connection errors
            self._disconnect(remote)
            raise KvPullError(f"context rank {remote} unreachable: {exc}") from exc
        if reply.op is AgentOp.REFUSED:
            raise KvPullError(f"context rank {remote} refused request {params.request_id}: {reply.reason}")
        if reply.op is not AgentOp.CLAIMED:
            raise KvPullError(f"unexpected answer {reply.op} from {remote}")
        t_claimed = time.monotonic()
        if after_claim is not None:
            after_claim()

        region = params.region
        bb = region.block_bytes
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
        pulled = AgentMessage(op=AgentOp.PULLED, request_id=params.request_id, nonce=nonce).encode()
        try:
            handle = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, local_mem),
                self._agent.get_xfer_descs(remote_descs, MemKind(region.mem).value), remote, pulled)
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + read_timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise KvPullError(f"READ of request {params.request_id} from {remote} "
                                  f"{'timed out' if state == 'PROC' else 'failed'} ({state})")
        except KvPullError:
            self._abort(remote, params.request_id, nonce)
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL errors (e.g. the remote agent vanished)
            self._abort(remote, params.request_id, nonce)
            raise KvPullError(f"READ of request {params.request_id} from {remote} failed: {exc}") from exc
        finally:
            if handle is not None:
                handle.release()
            self._agent.deregister_memory(reg)
        t_done = time.monotonic()
        kv = read_stream(dst[:params.stream_bytes], params.tensors)
        return PulledKv(params=params, kv=kv, nbytes=params.stream_bytes, claim_s=t_claimed - t0,
                        read_s=t_done - t_claimed)

    def _abort(self, remote: str, request_id: str, nonce: str) -> None:
        try:
            self._agent.send_notif(remote, AgentMessage(op=AgentOp.ABORT, request_id=request_id, nonce=nonce).encode())
        except Exception:  # noqa: BLE001 - the remote may be gone; its lease frees the KV anyway
            pass
        self._disconnect(remote)

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
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout-s", type=float, default=60.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    args = _parse_args(argv)
    prompt: Any = args.prompt if args.prompt is not None else [int(t) for t in args.prompt_ids.split(",")]
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    r = httpx.post(args.url.rstrip("/") + "/v1/completions", json=body, timeout=args.timeout_s)
    if r.status_code != 200:
        print(f"prefill failed: HTTP {r.status_code}: {r.text}", file=sys.stderr)
        return 1
    choice = r.json()["choices"][0]
    params = KvTransferParams.model_validate(choice["kv_transfer_params"])
    prompt_ids = params.prompt_token_ids or prompt  # the server's tokenization of a text prompt
    model = AutoModelForCausalLM.from_pretrained(args.model).to(args.device).eval()
    try:
        with KvPuller(device=args.device) as puller:
            pulled = puller.pull(params)
    except KvPullError as exc:
        print(f"pull failed: {exc}", file=sys.stderr)
        return 1
    with torch.inference_mode():
        tokens, _ = decode_from_params(model, prompt_ids, choice["token_ids"][0], pulled,
                                       max_new_tokens=args.max_new_tokens)
    print(json.dumps({"tokens": tokens, "pulled_bytes": pulled.nbytes, "claim_s": round(pulled.claim_s, 6),
                      "read_s": round(pulled.read_s, 6), "read_gbps": round(pulled.read_gbps, 3),
                      "engine": params.remote_engine_id, "dwdp_rank": params.dwdp_rank}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
