"""Float64 references for the kernel tests (plain torch loops: slow, obviously right)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACT = {"silu": F.silu, "relu": F.relu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def routing_lists(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(padded pair list, expert of each block) — what ``align_routing`` must produce."""
    flat = topk_ids.reshape(-1)
    pairs, blocks = [], []
    for e in range(num_experts):
        mine = (flat == e).nonzero().view(-1).tolist()
        padded = -(-len(mine) // block_m) * block_m
        pairs += mine + [flat.numel()] * (padded - len(mine))
        blocks += [e] * (padded // block_m)
    return pairs, blocks


def experts_ref(x, ids, w, gate_up, down, *, has_gate=True, transposed=False, concatenated=True,
                gate_up_bias=None, down_bias=None, activation="silu"):
    """Σ_j w[t,j] · down_e(act(gate_e x) · up_e x) in float64, weights given in their stored layout."""
    act = ACT[activation]
    gu = gate_up.double().transpose(1, 2) if transposed else gate_up.double()   # [E, N, K]
    dn = down.double().transpose(1, 2) if transposed else down.double()
    inter = dn.shape[2]
    out = torch.zeros(x.shape[0], dn.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gu.shape[0]:
                continue
            h = gu[e] @ x[t].double()
            if gate_up_bias is not None:
                h = h + gate_up_bias[e].double()
            if has_gate:
                g, u = (h[:inter], h[inter:]) if concatenated else (h[0::2], h[1::2])
                a = act(g) * u
            else:
                a = act(h)
            o = dn[e] @ a
            if down_bias is not None:
                o = o + down_bias[e].double()
            out[t] += float(w[t, j]) * o
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))
