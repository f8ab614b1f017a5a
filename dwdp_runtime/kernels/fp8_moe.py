"""One routed-experts forward with FP8 block-scaled experts: quantize → align → GEMM 1 → GEMM 2 → reduce.

``fp8_moe_forward(hidden [T, H], topk_ids, topk_weights, w1, s1, w2, s2)`` returns ``[T, H]`` in
``hidden``'s dtype = ``Σ_j w[t, j] · down_e(act(gate_e(x_t)) · up_e(x_t))`` where every GEMM is the exact
block-scaled product of e4m3 operands: weights ``w1 [E, 2I, H]`` / ``w2 [E, H, I]`` with fp32 scales per
128×128 block (``s1 [E, 2⌈I/128⌉, ⌈H/128⌉]``, ``s2 [E, ⌈H/128⌉, ⌈I/128⌉]`` — the composites DWDP binds, as
they are) and activations quantized per token and 128-column group on the fly (``fp8_quant`` for the input,
GEMM 1's epilogue for the intermediate). Routing plan and top-k reduction are the bf16 path's
(``routing.align_routing``, ``reduce.reduce_topk``): no host synchronisation, batch invariant.

HBM traffic versus the bf16 block: weights and the ``[rows, I]`` intermediate are 1 byte per element instead of
2; the input is read once in bf16 and once in e4m3 (``[T, H]``, small next to the weights at prefill sizes).

Backend (``DWDP_FP8_BACKEND``, read per call): ``auto`` (default) runs the CuTe DSL kernels (``fp8_cute``:
warp-specialised, sm_90) where they can run and these Triton kernels elsewhere; ``triton`` / ``cute`` force
one (``cute`` where it cannot run is an error naming why). The choice depends on the machine and the weights
only, never on the batch, so a process serves every batch with the same numerics.

Tiles: ``default_configs`` (below) or ``tune_fp8`` at warm-up (cached per shape key; never inside a forward).
BLOCK_K = 128 always (the scale block); each GEMM 1 program produces one 128-column activation group (in one
or two passes: ``fp8_grouped_gemm``).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch

from ..contract import TuningEnv, tuning_choice
from . import tuning
from ..quant.scheme import FP8_SCALE_BLOCK
from .fp8_grouped_gemm import fp8_down, fp8_gate_up
from .fp8_quant import quantize_groups
from .reduce import reduce_topk
from .routing import align_routing
from .support import log_choice_once

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Key:
    gemm: str
    n: int
    k: int
    num_experts: int
    top_k: int
    load: int


#: reduction length from which GEMM 1's weight tiles come through TMA descriptors by default: measured on an
#: H200 (2026-12-01, 16K tokens) 4 % faster at DeepSeek-V3's H = 7168, 6 % slower at Qwen3's H = 2048
TMA_MIN_HIDDEN = 4096


#: the row block of every batch: 64 rows is one wgmma warpgroup tile, while 16/32-row blocks compile to mma.sync,
#: whose fp32 sums over a 128-deep K step round otherwise — measured on an H100 (2026-12-07, W4A8 on these
#: kernels): a token alone differed from the same token among 4K. One row block keeps the FP8 experts batch
#: invariant; a decode-size batch pays the padded rows (a context server's batches fill them)
ROW_BLOCK = 64


def default_configs(load: int, hidden: int = 0) -> tuple[tuning.GemmConfig, tuning.GemmConfig]:
    """(gate_up, down) tiles: the H200 sweep's winners (2026-12-01, DeepSeek-V3 and Qwen3 expert shapes, 4K and
    16K tokens; docs/MODELS.md). Registers decide: every K step ends in a wait for the MMA and an FMA
    promotion of the fp32 partial (``acc += dot · s``), so a program's MMA and its promotion serialise and the
    SM stays busy only with several programs resident. Prefill loads: 64-row blocks of 4 warps —
    GEMM 1 in two 64-column passes per activation group (two [64, 64] accumulators + partials: 224
    registers, 2 programs per SM; the one-pass [64, 128] pair needs 8 warps and spills at 4), GEMM 2 64×128
    tiles, 3 stages, weight tiles through TMA (168 registers, 3 programs per SM: 1.2–1.5× bf16 there). 128-row
    blocks were 5–30 % slower in both GEMMs (one program per SM). Every load takes the same ``ROW_BLOCK``
    (batch invariance; ``load`` is kept for the callers' keys)."""
    g1 = tuning.GemmConfig(block_m=ROW_BLOCK, block_n=64, block_k=FP8_SCALE_BLOCK, num_warps=4, num_stages=3,
                           tma=hidden >= TMA_MIN_HIDDEN)
    g2 = tuning.GemmConfig(block_m=ROW_BLOCK, block_n=128, block_k=FP8_SCALE_BLOCK, num_warps=4, num_stages=3, tma=True)
    return g1, g2


def candidates(gemm: str, block_m: int | None, load: int) -> list[tuning.GemmConfig]:
    """Tiles the warm-up tuner tries: BLOCK_K 128 always; ``ROW_BLOCK`` rows (128-row blocks lost everywhere in
    the sweep; smaller ones are not batch invariant). GEMM 1: one or two passes
    per activation group (BLOCK_N 128 / 64) at 4 or 8 warps; GEMM 2: 128 columns at 4 warps, 3 or 4 stages;
    weight tiles through TMA or pointers. 8 configs per GEMM (each a compile at warm-up)."""
    ms = [block_m or ROW_BLOCK]
    if gemm == "gate_up":
        shapes = [(64, 4, 3), (64, 4, 4), (128, 8, 3), (64, 8, 3)]
    else:
        shapes = [(128, 4, 3), (128, 4, 4), (128, 4, 2), (256, 8, 3)]
    return [tuning.GemmConfig(block_m=m, block_n=n, block_k=FP8_SCALE_BLOCK, num_warps=warps, num_stages=stages, tma=tma)
            for m in ms for n, warps, stages in shapes for tma in (False, True)]


_TUNED: dict[Fp8Key, tuning.GemmConfig] = {}


def _keys(t: int, top_k: int, w1, w2) -> tuple[Fp8Key, Fp8Key]:
    e = w1.shape[0]
    load = tuning.load_bucket(t, top_k, e)
    return (Fp8Key("gate_up", w1.shape[1], w1.shape[2], e, top_k, load),
            Fp8Key("down", w2.shape[1], w2.shape[2], e, top_k, load))


def configs_for(t: int, top_k: int, w1, w2) -> tuple[tuning.GemmConfig, tuning.GemmConfig]:
    k1, k2 = _keys(t, top_k, w1, w2)
    d1, d2 = default_configs(k1.load, w1.shape[2])
    c1 = _TUNED.get(k1, d1)
    c2 = _TUNED.get(k2) or tuning.with_block_m(d2, c1.block_m)
    return c1, c2


def _check(w1, s1, w2, s2, has_gate: bool) -> tuple[int, int, int]:
    e, n1, hidden = w1.shape
    e2, h2, inter = w2.shape
    if w1.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8 experts need float8_e4m3fn weights, got {w1.dtype}/{w2.dtype}")
    if e2 != e or h2 != hidden or n1 != (2 * inter if has_gate else inter):
        raise ValueError(f"expert weights disagree: gate_up {tuple(w1.shape)}, down {tuple(w2.shape)}")
    up_srow = -(-inter // FP8_SCALE_BLOCK)
    want1 = (e, (2 if has_gate else 1) * up_srow, -(-hidden // FP8_SCALE_BLOCK))
    want2 = (e, -(-hidden // FP8_SCALE_BLOCK), up_srow)
    if tuple(s1.shape) != want1 or tuple(s2.shape) != want2:
        raise ValueError(f"scale grids {tuple(s1.shape)}/{tuple(s2.shape)} are not the 128×128 grids "
                         f"{want1}/{want2} of the weights (gate and up quantized separately)")
    return inter, hidden, up_srow


def _run(xq, xs, ids, topk_weights, w1, s1, w2, s2, cfg1, cfg2, *, has_gate, activation, out_dtype):
    inter, hidden, up_srow = _check(w1, s1, w2, s2, has_gate)
    plan = align_routing(ids, w1.shape[0], cfg1.block_m)
    aq, a_s = fp8_gate_up(xq, xs, w1, s1, plan, cfg1, inter=inter, up_srow=up_srow, has_gate=has_gate,
                          activation=activation)
    y = fp8_down(aq, a_s, w2, s2, topk_weights, plan, cfg2, hidden=hidden, out_dtype=out_dtype)
    return reduce_topk(y, ids, w1.shape[0], out_dtype=out_dtype)


class Fp8Backend(enum.StrEnum):
    AUTO = "auto"
    TRITON = "triton"
    CUTE = "cute"


#: environment variable choosing the backend (module docstring; listed with the other tuning variables)
BACKEND_ENV = str(TuningEnv.FP8_BACKEND)


def wanted_backend() -> Fp8Backend:
    """The backend ``BACKEND_ENV`` asks for (AUTO when unset)."""
    return tuning_choice(TuningEnv.FP8_BACKEND, Fp8Backend, Fp8Backend.AUTO)


def chosen_backend(w1: torch.Tensor, w2: torch.Tensor) -> Fp8Backend:
    """TRITON or CUTE for these weights on this machine (``BACKEND_ENV``; module docstring)."""
    wanted = wanted_backend()
    if wanted is Fp8Backend.CUTE and w1.device.type != "cuda":
        raise RuntimeError(f"{BACKEND_ENV}=cute but the weights are on {w1.device} (the CuTe kernels run on sm_90 GPUs)")
    if wanted is Fp8Backend.TRITON or w1.device.type != "cuda":
        return Fp8Backend.TRITON
    from . import fp8_cute

    why = fp8_cute.unusable(w1, w2)
    if why and wanted is Fp8Backend.CUTE:
        raise RuntimeError(f"{BACKEND_ENV}=cute but the CuTe FP8 kernels cannot run: {why}")
    chosen = Fp8Backend.TRITON if why else Fp8Backend.CUTE
    log_choice_once(log, "FP8 experts", f"on the {chosen.value} kernels", why)
    return chosen


def fp8_moe_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, *,
                    has_gate: bool = True, activation: str = "silu") -> torch.Tensor:
    """The routed experts' output ``[T, H]`` (see module docstring)."""
    if chosen_backend(w1, w2) is Fp8Backend.CUTE:
        from .fp8_cute import CuteBuildError, cute_fp8_moe_forward

        try:
            return cute_fp8_moe_forward(hidden_states, topk_ids, topk_weights, w1, s1, w2, s2, has_gate=has_gate,
                                        activation=activation)
        except CuteBuildError:
            # recorded: a forced ``cute`` backend now refuses with the reason, ``auto`` answers TRITON (once
            # per process, at the first forward — the warm-up, before /readyz — so no batch depends on it)
            if chosen_backend(w1, w2) is Fp8Backend.CUTE:
                raise
    return triton_fp8_moe_forward(hidden_states, topk_ids, topk_weights, w1, s1, w2, s2, has_gate=has_gate,
                                  activation=activation)


def triton_fp8_moe_forward(hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                           w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, *,
                           has_gate: bool = True, activation: str = "silu") -> torch.Tensor:
    """The routed experts' output ``[T, H]`` on the Triton kernels."""
    out_dtype = hidden_states.dtype if hidden_states.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    xq, xs = quantize_groups(hidden_states)
    cfg1, cfg2 = configs_for(hidden_states.shape[0], topk_ids.shape[1], w1, w2)
    out = _run(xq, xs, topk_ids, topk_weights, w1, s1, w2, s2, cfg1, cfg2, has_gate=has_gate,
               activation=activation, out_dtype=out_dtype)
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def tune_fp8(w1, s1, w2, s2, *, top_k: int, token_counts, has_gate: bool = True, activation: str = "silu",
             seed: int = 0, rep_ms: int = 20) -> dict[int, tuple[tuning.GemmConfig, tuning.GemmConfig]]:
    """Warm-up tuning (GPU), as ``moe.tune_experts``: GEMM 1 picks BLOCK_M, GEMM 2 its tiling under it."""
    import triton.testing

    inter, hidden, up_srow = _check(w1, s1, w2, s2, has_gate)
    e, dev = w1.shape[0], w1.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for t in token_counts:
        k1, k2 = _keys(t, top_k, w1, w2)
        x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        w, ids = torch.topk(torch.rand(t, e, device=dev, generator=gen), top_k, dim=-1)
        xq, xs = quantize_groups(x)

        def bench(fn):
            try:
                return float(triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"))
            except Exception:  # noqa: BLE001 - an infeasible config (out of resources) is not a choice
                return float("inf")

        def g1(c):
            plan = align_routing(ids, e, c.block_m)
            return lambda: fp8_gate_up(xq, xs, w1, s1, plan, c, inter=inter, up_srow=up_srow, has_gate=has_gate,
                                       activation=activation)

        times = {c: bench(g1(c)) for c in candidates("gate_up", None, k1.load)}
        c1 = min(times, key=times.get)
        _TUNED[k1] = c1
        plan = align_routing(ids, e, c1.block_m)
        aq, a_s = fp8_gate_up(xq, xs, w1, s1, plan, c1, inter=inter, up_srow=up_srow, has_gate=has_gate,
                              activation=activation)
        times2 = {c: bench(lambda c=c: fp8_down(aq, a_s, w2, s2, w, plan, c, hidden=hidden))
                  for c in candidates("down", c1.block_m, k1.load)}
        _TUNED[k2] = min(times2, key=times2.get)
        out[t] = (c1, _TUNED[k2])
    return out
