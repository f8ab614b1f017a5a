"""DEP: data-parallel attention + expert parallelism, the baseline DWDP is measured against.

Every rank runs attention and the router on its own sequences (as in DWDP); the experts are
partitioned: rank r owns ``[r·E//d, (r+1)·E//d)`` (``dep_bounds``). Per MoE layer (``DepMoE``):

  1. route locally → for every token the set of ranks that own one of its top-k experts;
  2. counts exchange: ``all_to_all_single`` of d int64 (rows this rank sends to each rank); the
     host reads them to size the buffers (one device→host sync per layer, as any DEP without
     worst-case preallocated buffers has);
  3. **dispatch** ``all_to_all_single``: ONE row per (token, destination rank) — a token with
     several experts on one rank is sent once (as DeepEP / TRT-LLM do) — carrying the normed
     hidden state plus, bit-packed into extra columns of the same tensor, its k expert ids and
     router weights masked to that rank's experts (id −1, weight 0 elsewhere);
  4. local grouped SwiGLU over the received (row, expert) pairs (``moe_stack.expert_pairs``), then
     the weighted partial sum per received row (float32 ``index_add_``);
  5. **combine** ``all_to_all_single``: the partial rows go back to their senders (activation dtype),
     which sum the partials of each token over the ranks.

So every MoE layer has two data all-to-alls (plus the tiny counts exchange) and every rank waits
for the slowest rank twice per layer. Backend: NCCL on GPU (``NCCL_NVLS_ENABLE=0``: NVLink
multicast stays off on the lent machines), gloo on CPU (torch 2.13's gloo implements
``all_to_all_single`` with uneven splits, so no isend/irecv fallback is needed).

Invariants: the bit-packing is exact (a byte copy, ids and weights come back bitwise); every
(token, expert) pair is computed exactly once, on the owner of the expert; a rank holds only its
own experts (generated straight into its slice, ``moe_stack.expert_weights``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .moe_stack import StackConfig, expert_pairs, expert_weights


def dep_bounds(num_experts: int, d: int) -> list[int]:
    """Rank r owns experts ``[b[r], b[r+1])``; sizes differ by at most one."""
    if not 1 <= d <= num_experts:
        raise ValueError(f"DEP needs 1 <= d <= num_experts (d={d}, num_experts={num_experts})")
    return [r * num_experts // d for r in range(d + 1)]


def _pack(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[P, k]`` 4-byte tensor as extra columns of ``dtype`` (bitwise; ``_unpack`` inverts)."""
    return t.contiguous().view(dtype)


def _unpack(cols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return cols.contiguous().view(dtype)


class DepMoE:
    """Callable ``(layer, hn [T,H], w [T,k] f32, ids [T,k]) → [T,H]`` for ``moe_stack.forward``."""

    def __init__(self, cfg: StackConfig, *, rank: int, world: int, device, dtype, impl: str, group=None):
        if dtype.itemsize > 4 or 4 % dtype.itemsize:
            raise ValueError(f"activation dtype {dtype} cannot carry 4-byte ids/weights as extra columns")
        self.cfg, self.rank, self.world, self.group, self.impl = cfg, rank, world, group, impl
        self.dtype, self.device = dtype, torch.device(device)
        b = dep_bounds(cfg.experts, world)
        self.lo, self.hi = b[rank], b[rank + 1]
        self._inner = torch.tensor(b[1:-1], device=self.device, dtype=torch.int64)
        self.experts = [expert_weights(cfg, l, self.lo, self.hi, device=self.device, dtype=dtype)
                        for l in range(cfg.layers)]
        self.stats = {"rows_sent": 0, "rows_sent_remote": 0, "pairs_computed": 0}

    def __call__(self, layer: int, hn: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        T, k = ids.shape
        H, d, dt = hn.shape[1], self.world, self.dtype
        # 1. which ranks each token goes to; rows sorted by destination, then token
        owner = torch.bucketize(ids, self._inner, right=True)                      # [T, k] in [0, d)
        hit = torch.zeros((T, d), dtype=torch.bool, device=hn.device).scatter_(1, owner, True)
        dest, tok = hit.t().nonzero(as_tuple=True)
        mine = owner[tok] == dest.unsqueeze(1)                                     # [P, k]
        rid = torch.where(mine, ids[tok], -1).to(torch.int32)
        rw = torch.where(mine, w[tok], 0.0).to(torch.float32)
        payload = torch.cat([hn[tok], _pack(rid, dt), _pack(rw, dt)], dim=1)
        cols = payload.shape[1] - H
        # 2. counts exchange
        send = hit.sum(0)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        sc, rc = send.tolist(), recv.tolist()
        # 3. dispatch
        got = payload.new_empty((sum(rc), payload.shape[1]))
        dist.all_to_all_single(got, payload, rc, sc, group=self.group)
        gh = got[:, :H]
        gid = _unpack(got[:, H:H + cols // 2], torch.int32)
        gw = _unpack(got[:, H + cols // 2:], torch.float32)
        # 4. local experts on the received pairs, weighted partial sum per received row
        m, j = (gid >= 0).nonzero(as_tuple=True)
        ex = self.experts[layer]
        y = expert_pairs(gh, m, gid[m, j].long() - self.lo, ex["gate_up_proj"], ex["down_proj"], self.impl)
        part = torch.zeros((got.shape[0], H), device=hn.device, dtype=torch.float32)
        part.index_add_(0, m, y.float() * gw[m, j].unsqueeze(1))
        # 5. combine: partials back to their senders, summed per token
        back = hn.new_empty((payload.shape[0], H))
        dist.all_to_all_single(back, part.to(dt), sc, rc, group=self.group)
        out = torch.zeros((T, H), device=hn.device, dtype=torch.float32).index_add_(0, tok, back.float())
        self.stats["rows_sent"] += payload.shape[0]
        self.stats["rows_sent_remote"] += payload.shape[0] - sc[self.rank]
        self.stats["pairs_computed"] += int(m.numel())
        return out.to(dt)
