"""Typed messages of the KV handoff (docs/KV_TRANSFER.md): what a response carries, what agents say.

``KvTransferParams`` is what a context server puts in a response's ``kv_transfer_params`` for a request
that asked ``{"do_remote_decode": true}``: everything a decode engine needs to pull that sequence's KV
with its own NIXL agent. Field names follow vLLM's ``NixlConnector`` where the meaning is the same
(``do_remote_prefill``/``do_remote_decode``, ``remote_engine_id``, ``remote_block_ids``,
``remote_host``, ``remote_port``); the rest are ours and documented per field.

``AgentMessage`` is the small JSON notification two NIXL agents exchange around a pull (claim →
claimed/refused → READ carrying ``pulled`` → the rank's verdict, released/stale). It travels as NIXL
notification bytes, so no extra port or side channel is needed.

Protocol ``dwdp-kv/2`` (``PROTOCOL``): every ``claim`` names it, and the rank answers every ``pulled`` with a
verdict; the decode side may use what it read only after ``released`` with ``valid: true``. A claim that
names no protocol or another one (a ``dwdp-kv/1`` consumer, which would use its bytes without waiting for a
verdict) is refused with a reason saying so, in a message a ``dwdp-kv/1`` consumer decodes (only the fields
``op``, ``request_id``, ``nonce``, ``reason``). Durations travel next to every wall-clock instant
(``ttl_s`` next to ``expires_at``, ``lease_s`` next to ``lease_until``): a decode host's clock may be off,
and nothing the decode side must decide needs its wall clock.

Invariants: every model is frozen and refuses unknown fields (a typo is an error, not a silent
default); ``KvTensorDesc.offset`` is a byte offset into the sequence's KV stream (the concatenation of
its blocks in ``remote_block_ids`` order), aligned to ``STREAM_ALIGN`` bytes so the decode side can view
it as any dtype.
"""

from __future__ import annotations

import json
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL = "dwdp-kv/2"
#: byte alignment of every tensor in a sequence's KV stream: a multiple of every dtype's size and of
#: the 64-byte cache line, so a view at any offset is aligned for any kernel
STREAM_ALIGN = 64


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KvKind(StrEnum):
    KEY = "key"
    VALUE = "value"


class MemKind(StrEnum):
    """Where the registered region lives (NIXL's segment names)."""

    DRAM = "DRAM"   # host memory (CPU ranks)
    VRAM = "VRAM"   # GPU memory (CUDA ranks)


class KvTensorDesc(_Frozen):
    """One cached tensor of one layer, laid out contiguously at ``offset`` of the sequence's stream."""

    layer: int = Field(ge=0)
    kind: KvKind
    dtype: str                      # torch dtype name without the prefix: "float32", "bfloat16", …
    shape: tuple[int, ...]          # as transformers caches it: [batch=1, heads, seq_len, head_dim]
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class KvRegionDesc(_Frozen):
    """The prefill rank's registered region (registered once; blocks index into it)."""

    mem: MemKind
    base_addr: int = Field(ge=0)    # address of block 0 in the prefill rank's address space
    device_id: int = Field(ge=0)    # CUDA device index for VRAM, 0 for DRAM
    block_bytes: int = Field(gt=0)
    num_blocks: int = Field(gt=0)


class RemoteDecodeRequest(_Frozen):
    """The request side: ``kv_transfer_params`` of a completion request."""

    do_remote_decode: bool = False


class KvTransferParams(_Frozen):
    """The response side: what a decode engine needs to pull one sequence's KV."""

    protocol: str = PROTOCOL
    # -- vLLM NixlConnector names, same meaning ------------------------------------------------------
    do_remote_prefill: bool = True   # for the decode side: the prefill was done remotely
    do_remote_decode: bool = False   # this response must not be handed on for another remote decode
    remote_engine_id: str            # the prefill rank's NIXL agent name (unique per rank and start)
    remote_block_ids: list[int]      # blocks of the region holding this sequence, in stream order
    remote_host: str | None = None   # the context server's HTTP address, as decode engines reach it (the front
    remote_port: int | None = None   # fills both: kv.address); no side channel listens there
    # -- ours ----------------------------------------------------------------------------------------
    remote_agent_metadata: str       # base64 NIXL agent metadata (a few hundred bytes): load it, then READ
    region: KvRegionDesc
    tensors: list[KvTensorDesc]      # every layer's key and value, in layer order
    stream_bytes: int = Field(ge=0)  # bytes of the sequence's KV stream (≤ blocks × block_bytes)
    seq_len: int = Field(gt=0)       # prompt tokens cached (the first generated token is not)
    model: str                       # the served model id
    dwdp_group: int = Field(ge=0)
    dwdp_rank: int = Field(ge=0)     # the DWDP rank that holds the KV
    request_id: str                  # the key of this sequence in the rank's store
    expires_at: float                # unix time (this server's clock) after which unclaimed KV is freed
    ttl_s: float = Field(gt=0)       # the same TTL as a duration from the response: claim within it
    lease_s: float = Field(gt=0)     # a claim's lease: confirm (the READ's `pulled`) within it, or get `stale`
    cache_layout: str = "transformers.DynamicCache"
    prompt_token_ids: list[int] | None = None  # filled by the front: the decode side continues from exactly these


class AgentOp(StrEnum):
    CLAIM = "claim"          # decode → prefill: lease the request for a pull (carries the decode agent's metadata)
    CLAIMED = "claimed"      # prefill → decode: leased for ``lease_s``; READ now
    REFUSED = "refused"      # prefill → decode: unknown / expired / lapsed / already pulled / protocol (``reason``)
    PULLED = "pulled"        # decode → prefill, as the READ's completion notification: confirm, free
    ABORT = "abort"          # decode → prefill: giving up; free it
    RELEASED = "released"    # prefill → decode, the verdict on ``pulled``: valid KV (``valid: true``), freed
    STALE = "stale"          # prefill → decode, the verdict on ``pulled``: discard what was read (``reason``)


class AgentMessage(_Frozen):
    op: AgentOp
    request_id: str
    nonce: str = ""                  # the decode side's claim id: a reply is matched to its claim
    protocol: str | None = None      # CLAIM: the protocol the decode side speaks (``PROTOCOL``)
    metadata: str | None = None      # CLAIM: the decode agent's base64 metadata (so the prefill side can reply)
    reason: str | None = None        # REFUSED, STALE
    lease_s: float | None = None     # CLAIMED: lease left when the rank answered (a duration: no clock to trust)
    lease_until: float | None = None  # CLAIMED: the same instant as unix time of the rank's clock (informational)
    valid: bool | None = None        # RELEASED: true; STALE: false

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "AgentMessage":
        return cls.model_validate(json.loads(raw))
