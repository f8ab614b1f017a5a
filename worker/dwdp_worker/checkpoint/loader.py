"""Local-expert loader: a `transformers` MoE model whose experts live in DWDP transport handles.

Pipeline (``load_sharded``):
  1. read ``config.json``; refuse quantized models with a clear ``UnsupportedModelError``;
  2. build the model on the **meta** device (no memory), with the dtype and the attention/experts
     implementations `from_pretrained` would pick — so the kernels match the unsharded oracle;
  3. discover its experts layout (``models.model_layout``) and map every checkpoint key to the model tensor
     it loads into by `transformers`' own conversion rules (``checkpoint_names``) — a compressed-tensors NVFP4
     checkpoint read under ModelOpt's names (``nvfp4_view``);
  4. load every dense tensor (attention, norms, embeddings, routers, shared experts, dense MLPs) fully
     onto ``manager.device`` from the safetensors files, in the dtype of the meta parameter;
  5. rebuild non-persistent buffers (rotary ``inv_freq``) with the owning (sub-)model's ``_init_weights``
     — the same path `from_pretrained` takes for them (loaded parameters flagged initialised);
  6. for each experts module (forward order) register the layer with DWDP and a ``fill`` callback per
     sharded tensor (weights and per-expert biases) that reads **only experts [a, b)** of this rank from
     safetensors (one expert at a time, or the row range of a fused tensor) straight into the transport
     handle with ``pread`` (the same readers reload experts a lost rank held: ``manager.reload_source``
     reopens the files, issue #30);
  7. ``manager.setup()`` (handle exchange, composites), then bind each experts parameter to its
     composite ``[E, ...]`` tensor (zero-copy).

Memory invariant: a rank holds its local experts (in the transport handles) and the dense weights, plus at
most one expert projection in a staging buffer when a dtype/device conversion is needed. Files are read
with ``pread``, not mapped, so no file page stays resident in the rank (see ``SafetensorsIndex``).
A failure anywhere releases the manager's handles (``manager.setup`` rolls back; callers own ``manager``).
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from dataclasses import dataclass
from typing import Any

from ..model import registry as arch
from . import fp8_dense
from ..model.meta_model import build_meta_model  # re-exported: callers import it from the loader
from . import quant_loading as quant
from .names import CheckpointMap, apply_slice_ops, dense_tensors
from .nvfp4_view import modelopt_view
from ..model.experts_layout import ExpertParam, ExpertsLayout, ModelLayout, ParamRole, SourceKind
from .safetensors_index import CheckpointError, SafetensorsIndex

log = logging.getLogger(__name__)


def read_config_json(model_dir) -> dict:
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a directory written by save_pretrained; "
                              f"`dwdp-worker synth ARCH --out DIR` writes a synthetic one)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


#: ModelOpt's quantization file beside config.json (older exports; newer ones write quantization_config)
HF_QUANT_CONFIG = "hf_quant_config.json"


def load_config(model_dir):
    """The checkpoint's `transformers` config, checked; a ModelOpt ``hf_quant_config.json`` becomes its
    ``quantization_config`` when config.json has none (as vLLM and SGLang read those checkpoints)."""
    from transformers import AutoConfig

    from dwdp_runtime.quant import UnsupportedQuantizationError, modelopt_config_from_hf_quant

    read_config_json(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{model_dir}: cannot read the transformers config ({exc})") from None
    hf_quant = pathlib.Path(model_dir) / HF_QUANT_CONFIG
    if hf_quant.is_file() and not getattr(config, "quantization_config", None):
        try:
            config.quantization_config = modelopt_config_from_hf_quant(json.loads(hf_quant.read_text()))
        except (json.JSONDecodeError, UnsupportedQuantizationError) as exc:
            raise CheckpointError(f"{hf_quant}: {exc}") from None
    arch.check_supported_config(config)
    return config


def resolve_dtype(config, dtype):
    """``dtype`` (str/torch.dtype/None); None → the checkpoint's dtype (config ``dtype``/``torch_dtype``)."""
    import torch

    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if not isinstance(getattr(torch, name, None), torch.dtype):
            raise ValueError(f"dtype {dtype!r} is not a torch dtype (use float32, bfloat16 or float16)")
        dtype = getattr(torch, name)
    return dtype


def _set_tensor(model, name: str, value, *, buffer: bool) -> None:
    import torch

    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if buffer:
        mod._buffers[attr] = value
    else:  # requires_grad as from_pretrained leaves it: some kernels (Jamba's selective scan) branch on it
        old = mod._parameters.get(attr)
        mod._parameters[attr] = torch.nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)


@dataclass
class LoadReport:
    dense_bytes: int
    local_expert_bytes: int
    total_expert_bytes: int
    largest_local_weight: int   # bytes of the largest single (layer, weight) local share
    layers: list[int]
    local_scale_bytes: int = 0  # of local_expert_bytes: the block scales (FP8 ``*_scale_inv``)
    mapped: Any = None          # quant.ExpertMemory: mapped bytes by part (weights, scales, pool), as planned
    model_s: float = 0.0        # the meta model (its transformers modeling module imported, modules built) and the
                                # checkpoint's names (headers parsed, transformers' conversion rules matched)
    read_s: float = 0.0         # checkpoint read (dense + local experts, their allocation included)
    map_s: float = 0.0          # manager.setup: peer handles exchanged, composites mapped


def dtype_plan(model, dtype) -> dict:
    """``from_pretrained``'s per-tensor dtype overrides: ``_keep_in_fp32_modules_strict`` stays float32 in
    bf16/fp16 (DeepSeek-V3's ``e_score_correction_bias``), ``_keep_in_fp32_modules`` in fp16."""
    get = getattr(model, "_get_dtype_plan", None)
    return dict(get(dtype)) if get is not None else {}


def target_dtype(name: str, default, plan: dict):
    import re

    for pattern, dt in plan.items():
        if pattern in name or re.search(pattern, name):
            return dt
    return default


def load_dense(model, layout: ModelLayout, cmap: CheckpointMap, ckpt: SafetensorsIndex, device, *,
               progress: bool = False, dtype=None) -> int:
    """Load every non-expert parameter/persistent buffer; rebuild non-persistent buffers. Returns bytes.
    FP8 and NVFP4 tensors are dequantized here (``quant_loading.dense_reader``; ``fp8_dense``: kept FP8)."""
    plan = dtype_plan(model, dtype) if dtype is not None else {}

    non_persistent = {n for n, _ in model.named_non_persistent_buffers()} if hasattr(
        model, "named_non_persistent_buffers") else set()
    todo = {n: (t, False) for n, t in model.named_parameters() if not layout.is_sharded(n)}
    todo.update({n: (t, True) for n, t in model.named_buffers() if n not in non_persistent})
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    nbytes = 0
    done: set[str] = set()
    read = quant.dense_reader(ckpt, device)
    from tqdm.auto import tqdm

    for name in tqdm(list(todo), desc="dwdp: loading dense weights", unit="tensor", leave=False,
                     disable=not progress):
        if name in done:
            continue
        kept = fp8_dense.load(model, name, cmap, ckpt, device, target_dtype(name, todo[name][0].dtype, plan))
        if kept is not None:  # DWDP_FP8_DENSE=on: kept e4m3 with its block scales
            nbytes += kept
            done.add(name)
            continue
        produced = dense_tensors(model, name, cmap, read)  # a converter may produce several (q, k, v)
        for out_name, value in produced.items():
            if out_name not in todo or out_name in done:
                continue
            meta, is_buffer = todo[out_name]
            if tuple(value.shape) != tuple(meta.shape):
                raise CheckpointError(f"{out_name}: checkpoint shape {tuple(value.shape)} != model shape "
                                      f"{tuple(meta.shape)} (config.json does not match the weights)")
            want = target_dtype(out_name, meta.dtype, plan) if meta.is_floating_point() else meta.dtype
            value = value.to(device=device, dtype=want)
            _set_tensor(model, out_name, value, buffer=is_buffer)
            nbytes += value.numel() * value.element_size()
            done.add(out_name)
    missing = [n for n in todo if n not in done and n not in tied]
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} dense tensor(s), e.g. {missing[:3]}")
    if tied:
        model.tie_weights()
    _init_non_persistent_buffers(model, non_persistent, device)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if t.device.type == "meta" and not layout.is_sharded(n)]
    if leftover:
        raise CheckpointError(f"tensors left uninitialised after loading: {leftover[:5]}")
    return nbytes


def _init_non_persistent_buffers(model, names, device) -> None:
    """Non-persistent buffers (rotary ``inv_freq``, …): empty on the device, then the ``_init_weights`` of the
    (sub-)model owning the module — what ``from_pretrained`` does. Loaded parameters of the same module are
    flagged ``_is_hf_initialized`` first, the flag `transformers`' init functions honour, so only the buffers
    are (re)computed."""
    import torch
    from transformers import PreTrainedModel

    owners = set()
    for name in names:
        buf = model.get_buffer(name)
        _set_tensor(model, name, torch.empty_like(buf, device=device), buffer=True)
        owners.add(name.rpartition(".")[0])
    with torch.no_grad():
        for owner in sorted(owners):
            module = model.get_submodule(owner)
            for p in module.parameters(recurse=False):
                p._is_hf_initialized = True
            parts = owner.split(".") if owner else []
            init_model = model
            for i in range(len(parts), 0, -1):  # the deepest PreTrainedModel above the module dispatches its init
                candidate = model.get_submodule(".".join(parts[:i]))
                if isinstance(candidate, PreTrainedModel):
                    init_model = candidate
                    break
            init_model._init_weights(module)


def _expert_reader(ckpt: SafetensorsIndex, experts: ExpertsLayout, param: ExpertParam, progress_bar):
    """fill(view, a, b): write experts [a, b) of ``param`` into ``view`` ([b−a, ...] on the handle's device).

    FUSED: rows [a, b) of one tensor (one byte range; per expert through a one-expert staging buffer when the
    checkpoint stores another layout: ``slice_ops``). PER_EXPERT: expert e's parts read one after the other into their
    slices of ``view[e − a]`` (contiguous rows when the parts concatenate along dim 0)."""
    import torch

    src = param.source
    full = experts.full_name(param.name)
    if src is None:
        raise CheckpointError(f"{full}: no checkpoint source resolved")

    def fill(view, a: int, b: int) -> None:
        if src.kind is SourceKind.FUSED:
            key = src.fused_key
            if not src.slice_ops:
                ckpt.read_rows(key, a, b, view)
            else:  # one expert at a time through transformers' own ops (one-expert staging buffer)
                staging = torch.empty((1, *ckpt.shape(key)[1:]), dtype=ckpt.entries[key].dtype)
                for e in range(a, b):
                    ckpt.read_rows(key, e, e + 1, staging)
                    view[e - a].copy_(apply_slice_ops(src.slice_ops, staging)[0])
            progress_bar.update(b - a)
            return
        dim = src.concat_dim
        for e in range(a, b):
            offset = 0
            for key in src.keys(e):
                stored = ckpt.shape(key)
                shape = stored or (1,)  # a 0-d part (NVFP4's per-projection weight_scale_2) is one element
                n = shape[dim]
                dst = view[e - a].narrow(dim, offset, n)
                ckpt.read_rows(key, 0, shape[0], dst if stored else dst.reshape(()))
                offset += n
            progress_bar.update(1)

    return fill


@dataclass(frozen=True)
class LoadedModel:
    """What ``load_sharded`` built: the model, what was read, and the experts forwards its quantization needs
    (``model.attach`` installs them)."""
    model: Any
    report: LoadReport
    overrides: tuple = ()   # attach.ForwardOverride per quantized experts module


def load_sharded(model_dir, manager, *, dtype=None, progress: bool = False, config=None) -> LoadedModel:
    """Build the model with dense weights loaded and experts bound to DWDP composites. Runs ``manager.setup()``.

    The resolved ``ModelLayout`` is ``model.dwdp_layout``.
    """
    import torch

    t_start = time.monotonic()
    model_dir = pathlib.Path(model_dir)
    config = config or load_config(model_dir)
    arch.check_supported_config(config)
    dtype = resolve_dtype(config, dtype)
    device = torch.device(manager.device)
    model = build_meta_model(config, dtype)
    layout = arch.model_layout(model)
    a, b = manager.local_range
    qc = quant.quant_config_of(config)
    with SafetensorsIndex(model_dir) as index:
        ckpt = modelopt_view(index, qc)   # compressed-tensors NVFP4 under ModelOpt's names; else the index
        # the names are the model's, not the read's: `transformers`' conversion rules are built (regexes of every
        # model type, ~0.1 s on a GPU host) before the first byte is asked for, so ``read_s`` times the reads
        cmap = CheckpointMap.build(model, ckpt.entries)
        layout, quantized = quant.resolve_layout(layout, qc, cmap, ckpt)
        t_read = time.monotonic()
        dense = load_dense(model, layout, cmap, ckpt, device, progress=progress, dtype=dtype)
        plan = dtype_plan(model, dtype)
        from tqdm.auto import tqdm

        total_local = sum(len(e.params) for e in layout.experts) * (b - a)
        local_bytes = total_bytes = largest = scale_bytes = 0
        with tqdm(total=total_local, desc=f"dwdp: loading local experts [{a}, {b})", unit="expert", leave=False,
                  disable=not progress) as bar:
            for experts in layout.experts:
                manager.add_layer(experts.layer)
                for p in experts.params:
                    # quantized tensors keep their declared dtype (no fp32 override of an e4m3 weight)
                    stored = experts.path in quantized and p.role is not ParamRole.BIAS
                    wdt = p.dtype if stored else target_dtype(experts.full_name(p.name), p.dtype, plan)
                    manager.add_expert_weight(experts.layer, p.name, expert_shape=p.expert_shape, dtype=wdt,
                                              fill=_expert_reader(ckpt, experts, p, bar))
                    per_expert = p.numel * torch.empty((), dtype=wdt).element_size()
                    local_bytes += (b - a) * per_expert
                    largest = max(largest, (b - a) * per_expert)
                    total_bytes += experts.num_experts * per_expert
                    scale_bytes += (b - a) * per_expert if p.role.value == "scale" else 0
        index.drain()
        staged, staged_s = index.staging_totals()
    t_map = time.monotonic()
    if staged:
        log.info("checkpoint reads into GPU memory: %.1f MiB in %.3f s of the %.3f s read (%.2f GB/s inside the "
                 "reads; the rest is the loader's allocation and bookkeeping)", staged / 2**20, staged_s,
                 t_map - t_read, staged / staged_s / 1e9 if staged_s else 0.0)
    # the same readers serve a reload of experts no survivor holds (issue #30): the files reopen for it
    manager.reload_source = ckpt.reopened
    manager.setup()
    t_done = time.monotonic()
    for experts in layout.experts:
        module = model.get_submodule(experts.path)
        for p in experts.params:
            meta = module._parameters.get(p.name)  # None: a quantization's extra tensor (scales)
            composite = manager.composite(experts.layer, p.name)  # packed FP4 is uint8: no gradient possible
            grad = meta is not None and meta.requires_grad and composite.is_floating_point()
            module._parameters[p.name] = torch.nn.Parameter(composite, requires_grad=grad)
    overrides = quant.overrides(quantized, dtype)
    model.dwdp_layout = layout
    by_part = quant.mapped_memory(manager, layout, dtype)
    log.info("loaded %s from %s: dense %.1f MiB, local experts [%d, %d) %.1f MiB of %.1f MiB (mapped: %s)",
             layout.model_type, model_dir, dense / 2**20, a, b, local_bytes / 2**20, total_bytes / 2**20, by_part)
    report = LoadReport(dense, local_bytes, total_bytes, largest, layout.layers, local_scale_bytes=scale_bytes,
                        mapped=by_part, model_s=t_read - t_start, read_s=t_map - t_read,
                        map_s=t_done - t_map)
    return LoadedModel(model, report, overrides)


def unbind_experts(model) -> None:
    """Point the expert parameters back at meta tensors (after ``manager.release()`` the composites are unmapped:
    a stray forward then fails loudly instead of reading unmapped memory)."""
    import torch

    layout = getattr(model, "dwdp_layout", None) or arch.model_layout(model)
    for experts in layout.experts:
        module = model.get_submodule(experts.path)
        for p in experts.params:
            old = module._parameters[p.name]
            module._parameters[p.name] = torch.nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device="meta"),
                                                            requires_grad=False)


__all__ = ["CheckpointError", "LoadReport", "LoadedModel", "build_meta_model", "load_config", "load_sharded", "read_config_json",
           "resolve_dtype", "unbind_experts"]
