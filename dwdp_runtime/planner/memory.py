"""Per-GPU memory of a DWDP rank, by part, and the fit check the operator calls.

Pure. Parts (bytes):
  dense_weights  replicated on every rank: embedding (+ LM head unless tied) in bf16, attention
                 projections and dense FFNs at ``dense_dtype``, routers bf16, shared experts at
                 ``dtype``, RMSNorm weights bf16.
  local_experts  the local handle of ``layout.composite_layout`` per (MoE layer, tensor): the
                 rank's experts rounded up to the 2 MiB VMM granularity (docs/DRIVER_FACTS.md). Two tensors
                 per layer, gate_up ``[k, 2I, H]`` and down ``[k, H, I]``. For ``fp8``, ``nvfp4`` and
                 ``mxfp4`` the tensors are the ones ``dwdp_runtime.quant`` declares (e4m3 or packed
                 E2M1 weights here — FP4: half a byte per weight —, their scales in
                 ``local_expert_scales``: own handles, each rounded to a granule), counted by
                 ``quant.expert_memory`` — the function the loader's report uses too.
  replica_experts  with ``expert_replicas`` r > 1 (``layout.holder_layout``): the replica runs a rank
                 keeps for its r−1 ring predecessors, each run its own handle per (MoE layer, tensor),
                 weights and scales; worst rank. 0 for r = 1.
  pool_slots     ``slots`` × the pool pages (16 MiB = 8 × granularity) one MoE layer's composite
                 layouts map (``CompositeLayout.pool_pages``: pre pages up to the first local expert,
                 post pages up to expert N). A slot's pages are reused by every layer mapped to it,
                 so the pool is per slot, not per layer. Worst rank reported.
  activations    a rough peak for ``max_num_tokens`` tokens in flight (residual stream + the larger
                 of the attention and MoE stages, bf16).
  graph_pool     with CUDA graphs (``cuda_graphs``; the worker's default on GPU ranks of a group that is not
                 elastic): the graphs' one shared memory pool, the same estimate for the largest padded shape
                 (``graph_buckets.largest_bucket_tokens(max_num_tokens)``) — held beside the eager forwards'
                 activations, which still run (warm-ups, shapes without a graph).
  w4a8_scratch   FP4 experts (``nvfp4``, ``mxfp4``) served W4A8, the worker's default (``kernels.w4a8_moe``;
                 gpt-oss's 2880-wide rows are blocked with a ragged edge): the experts re-encoded to e4m3 + block
                 scales while a layer runs, in chunks of at most ``quant.memory.W4A8_SCRATCH_BUDGET`` (1 GiB) per
                 projection (``quant.w4a8_scratch_bytes``; DeepSeek-R1's whole layer would be 11.3 GB).
                 ``fp4_kernel="weight-only"`` plans without it (``DWDP_FP4_KERNEL=weight-only`` on the workers).
  reserved       the hardware preset's ``reserved_bytes`` (CUDA context, workspaces; assumed).
  kv_cache       what remains; ``kv_needed`` = tokens × KV bytes/token for the planned workload.
"""

from __future__ import annotations


from pydantic import BaseModel

from .. import layout, quant
from ..contract import FP4_KERNELS, Fp4Kernel
from ..graph_buckets import largest_bucket_tokens

from .model_shapes import ModelShape, load_model
from .presets import ACT_BYTES, GIB, MIB, Hardware, WeightDtype, get_dtype, get_hardware
from ..serving_options import DEFAULTS as SERVING_DEFAULTS

GRANULARITY = 2 * MIB  # docs/DRIVER_FACTS.md: minimum = recommended VMM granularity on H200
POOL_PAGE = layout.pool_page_bytes(GRANULARITY)  # 16 MiB: the runtime's pool page


class MemoryBreakdown(BaseModel):
    """Bytes per GPU (worst rank). ``*_gib`` views are in the JSON output."""

    capacity: float
    dense_weights: float
    local_experts: float
    pool_slots: float
    local_expert_scales: float = 0.0
    replica_experts: float = 0.0
    activations: float
    reserved: float
    graph_pool: float = 0.0
    w4a8_scratch: float = 0.0
    kv_cache_available: float
    kv_needed: float = 0.0

    @property
    def used(self) -> float:
        return (self.dense_weights + self.local_experts + self.local_expert_scales + self.replica_experts
                + self.pool_slots
                + self.activations + self.graph_pool + self.w4a8_scratch + self.reserved)

    @property
    def fits_weights(self) -> bool:
        return self.kv_cache_available >= 0

    @property
    def fits(self) -> bool:
        return self.kv_cache_available >= self.kv_needed

    def gib(self) -> dict[str, float]:
        parts = ("capacity", "dense_weights", "local_experts", "local_expert_scales", "replica_experts",
                 "pool_slots", "activations", "graph_pool", "w4a8_scratch",
                 "reserved", "kv_cache_available", "kv_needed")
        return {p: round(getattr(self, p) / GIB, 3) for p in parts}


def dense_weight_bytes(shape: ModelShape, *, dtype: WeightDtype, dense_dtype: WeightDtype) -> float:
    h = shape.hidden
    b = shape.vocab * h * ACT_BYTES * (1 if shape.tie_embeddings else 2) + h * ACT_BYTES  # + final norm
    attn = sum(i * o for i, o in shape.attention_linear_dims()) * dense_dtype.bytes_per_element
    moe_set = set(shape.moe_layers)
    for layer in range(shape.num_layers):
        b += attn + 2 * h * ACT_BYTES
        if layer in moe_set:
            b += h * shape.num_experts * ACT_BYTES + 3 * h * shape.shared_inter * dtype.bytes_per_element
        else:
            b += 3 * h * shape.dense_inter * dense_dtype.bytes_per_element
    return float(b)


#: expert dtype -> the dtype the worker holds that checkpoint's dense linears in (dequantized at load:
#: docs/MODELS.md FP8 and FP4 sections; pass --dense-dtype to plan for a quantized dense GEMM instead)
DEQUANTIZED_DENSE = {"fp8": "bf16", "nvfp4": "bf16", "mxfp4": "bf16"}

#: expert dtypes a worker serves W4A8 by default (``DWDP_FP4_KERNEL=auto``) where the shapes allow
W4A8_DTYPES = ("nvfp4", "mxfp4")


def w4a8_scratch(shape: ModelShape, *, dtype: WeightDtype, fp4_kernel: str = "auto") -> float:
    """The W4A8 re-encoding's bytes for this model and expert dtype (module docstring; 0 where it does not run)."""
    if fp4_kernel not in FP4_KERNELS:   # the workers' DWDP_FP4_KERNEL values
        raise ValueError(f"fp4_kernel {fp4_kernel!r}: one of {FP4_KERNELS}")
    if dtype.name not in W4A8_DTYPES or fp4_kernel == Fp4Kernel.WEIGHT_ONLY:
        return 0.0
    return float(quant.w4a8_scratch_bytes(shape.num_experts, shape.hidden, shape.moe_inter))


#: planner dtypes -> the expert tensors ``dwdp_runtime.quant`` declares for them (every dtype has one)
_DECLARED = {"bf16": quant.UNQUANTIZED, "fp8": quant.FP8_BLOCK_SCHEME, "nvfp4": quant.NVFP4_SCHEME,
             "mxfp4": quant.MXFP4_SCHEME}


def _declared_memory(shape: ModelShape, dtype: WeightDtype, ranges, rank: int, slots: int):
    scheme = _DECLARED[dtype.name]
    i, h = shape.moe_inter, shape.hidden
    tensors = quant.layer_tensors(scheme, [("gate_up_proj", (2 * i, h), (i, i)), ("down_proj", (h, i), ())])
    return quant.expert_memory(tensors=tensors, num_moe_layers=shape.num_moe_layers, num_experts=shape.num_experts,
                               ranges=ranges, rank=rank, slots=slots, granularity=GRANULARITY,
                               compute_itemsize=ACT_BYTES)


def local_expert_bytes(shape: ModelShape, *, dtype: WeightDtype, experts_per_worker: int) -> float:
    return float(_declared_memory(shape, dtype, [(0, experts_per_worker)], 0, 1).weights)


def local_expert_scale_bytes(shape: ModelShape, *, dtype: WeightDtype, experts_per_worker: int) -> float:
    """The local handles of the experts' scales (0 for bf16)."""
    return float(_declared_memory(shape, dtype, [(0, experts_per_worker)], 0, 1).scales)


def replica_expert_bytes(shape: ModelShape, *, dtype: WeightDtype, ranges: list[tuple[int, int]],
                         expert_replicas: int) -> float:
    """The worst rank's replica runs (weights + scales), each run rounded like a local handle."""
    if expert_replicas <= 1:
        return 0.0
    d, k, s = len(ranges), ranges[0][1] - ranges[0][0], (ranges[1][0] if len(ranges) > 1 else 1)
    holders = layout.holder_layout(dwdp_size=d, num_experts=shape.num_experts, num_experts_per_worker=k,
                                   num_prefetch_experts=max(1, s), expert_replicas=expert_replicas)
    if holders.primary != tuple(ranges):
        raise ValueError(f"ranges {ranges} are not peer_ranges(k={k}, s={s})")

    def run_bytes(n: int) -> float:
        mem = _declared_memory(shape, dtype, [(0, n)], 0, 1)
        return float(mem.weights + mem.scales)
    return max(sum(run_bytes(b - a) for a, b in holders.replicas[r]) for r in range(d))


def pool_slot_bytes(shape: ModelShape, *, dtype: WeightDtype, ranges: list[tuple[int, int]], slots: int) -> float:
    """``slots`` × the worst rank's pool pages for one MoE layer (see module docstring)."""
    per_slot = max(_declared_memory(shape, dtype, ranges, r, 1).pool for r in range(len(ranges)))
    return float(slots * per_slot)


def activation_bytes(shape: ModelShape, *, tokens: float) -> float:
    h = shape.hidden
    q_k_v_o = shape.num_heads * (2 * shape.qk_dim + 2 * shape.v_dim) if shape.is_mla else \
        2 * shape.num_heads * shape.head_dim + 2 * shape.num_kv_heads * shape.head_dim
    attn_stage = q_k_v_o
    moe_stage = shape.top_k * (h + 3 * shape.moe_inter) + 3 * max(shape.shared_inter, 0)
    return float(tokens * (2 * h + max(attn_stage, moe_stage)) * ACT_BYTES)


def breakdown(*, model, dtype, hardware, ranges: list[tuple[int, int]], experts_per_worker: int,
              prefetch_slots: int, dense_dtype=None, max_num_tokens: float = SERVING_DEFAULTS.max_num_tokens,
              kv_tokens: float = 0, expert_replicas: int = 1, cuda_graphs: bool | None = None,
              fp4_kernel: str = "auto") -> MemoryBreakdown:
    """``cuda_graphs``: count the graphs' pool (``None``: as the worker decides unset — on unless the group is
    elastic, ``expert_replicas`` > 1). ``fp4_kernel``: the workers' ``DWDP_FP4_KERNEL`` (W4A8's scratch)."""
    shape = load_model(model)
    hw: Hardware = get_hardware(hardware)
    dt = get_dtype(dtype)
    ddt = get_dtype(dense_dtype) if dense_dtype is not None else dt
    shared_dt = dt
    if dt.name in DEQUANTIZED_DENSE and dense_dtype is None:
        # the worker dequantizes an fp8 checkpoint's attention, dense MLPs and shared experts at load
        ddt = shared_dt = get_dtype(DEQUANTIZED_DENSE[dt.name])
    parts = dict(
        dense_weights=dense_weight_bytes(shape, dtype=shared_dt, dense_dtype=ddt),
        local_experts=local_expert_bytes(shape, dtype=dt, experts_per_worker=experts_per_worker),
        local_expert_scales=local_expert_scale_bytes(shape, dtype=dt, experts_per_worker=experts_per_worker),
        replica_experts=replica_expert_bytes(shape, dtype=dt, ranges=ranges, expert_replicas=expert_replicas),
        pool_slots=pool_slot_bytes(shape, dtype=dt, ranges=ranges, slots=prefetch_slots),
        activations=activation_bytes(shape, tokens=max_num_tokens),
        graph_pool=activation_bytes(shape, tokens=largest_bucket_tokens(int(max_num_tokens)))
        if (expert_replicas == 1 if cuda_graphs is None else cuda_graphs) else 0.0,
        w4a8_scratch=w4a8_scratch(shape, dtype=dt, fp4_kernel=fp4_kernel),
        reserved=float(hw.reserved_bytes),
    )
    avail = hw.memory_bytes - sum(parts.values())
    return MemoryBreakdown(capacity=float(hw.memory_bytes), kv_cache_available=avail,
                           kv_needed=float(kv_tokens * shape.kv_bytes_per_token()), **parts)


def memory_fit(*, model, dtype, hardware, dwdp_size: int, experts_per_worker: int, prefetch_stride: int,
               prefetch_slots: int, dense_dtype=None, max_num_tokens: int = SERVING_DEFAULTS.max_num_tokens,
               min_kv_gib: float = 0.0, expert_replicas: int = 1) -> tuple[bool, str, MemoryBreakdown | None]:
    """Can this DWDP group's weights, experts and pool slots fit one GPU?

    Arguments: ``model`` a preset name, config.json path, dict or ``ModelShape``; ``dtype`` and
    ``hardware`` preset names; the four DWDP numbers as in the CRD (dwdpSize, numExpertsPerWorker,
    numPrefetchExperts, numPrefetchSlots) and ``expert_replicas`` (experts.replicas). ``max_num_tokens`` sizes the activation estimate;
    ``min_kv_gib`` the KV cache the deployment insists on keeping.

    Returns ``(fits, message, breakdown)``: the message is one line with the numbers (suitable for a
    status condition). An invalid sharding or unknown preset returns ``(False, why, None)`` instead
    of raising, so the operator can mark the group Invalid with it.
    """
    from .model_shapes import ModelConfigError
    from .presets import PresetError
    from .prefetch import expert_ranges

    try:
        shape = load_model(model)
        hw = get_hardware(hardware)
        ranges = expert_ranges(dwdp_size=dwdp_size, num_experts=shape.num_experts,
                               experts_per_worker=experts_per_worker, stride=prefetch_stride)
        if prefetch_slots < 2:
            raise ValueError(f"num_prefetch_slots={prefetch_slots}: at least 2 slots are needed")
        if not 1 <= expert_replicas <= dwdp_size:
            raise ValueError(f"expert_replicas={expert_replicas} must be in [1, dwdp_size={dwdp_size}]")
        bd = breakdown(model=shape, dtype=dtype, hardware=hw, ranges=ranges, experts_per_worker=experts_per_worker,
                       prefetch_slots=prefetch_slots, dense_dtype=dense_dtype, max_num_tokens=max_num_tokens,
                       expert_replicas=expert_replicas)
    except (ModelConfigError, PresetError, ValueError) as e:
        return False, str(e), None
    g = bd.gib()
    need_kv = min_kv_gib * GIB
    fits = bd.kv_cache_available >= need_kv
    scales = f" + scales {g['local_expert_scales']:.2f}" if bd.local_expert_scales else ""
    detail = (f"dense {g['dense_weights']:.1f} + local experts {g['local_experts']:.1f} (k={experts_per_worker})"
              f"{scales} "
              + (f"+ replicas {g['replica_experts']:.1f} (r={expert_replicas}) " if bd.replica_experts else "")
              + f"+ pool {g['pool_slots']:.1f} ({prefetch_slots} slots) + activations {g['activations']:.1f} "
              + (f"+ CUDA graphs {g['graph_pool']:.1f} " if bd.graph_pool else "")
              + f"+ reserved {g['reserved']:.1f} GiB of {g['capacity']:.1f} GiB on {hw.name}")
    if fits:
        return True, f"fits: {detail}; {g['kv_cache_available']:.1f} GiB left for KV cache", bd
    short = (need_kv - bd.kv_cache_available) / GIB
    hint = "raise dwdpSize, lower numExpertsPerWorker or numPrefetchSlots, or use a smaller dtype"
    if expert_replicas > 1:
        hint += f", or lower experts.replicas (now {expert_replicas})"
    return False, f"does not fit: {detail}; short by {short:.1f} GiB; {hint}", bd
