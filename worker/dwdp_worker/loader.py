"""Local-expert loader: a `transformers` MoE model whose experts live in DWDP transport handles.

Pipeline (``load_sharded``):
  1. read ``config.json``; refuse unsupported/quantized models with a clear ``UnsupportedModelError``;
  2. build the model on the **meta** device (no memory), with the dtype and the attention/experts
     implementations `from_pretrained` would pick — so the kernels match the unsharded oracle;
  3. load every dense tensor (attention, norms, embeddings, routers, shared experts, dense MLPs) fully
     onto ``manager.device`` from the safetensors files, in the dtype of the meta parameter;
  4. rebuild non-persistent buffers (rotary ``inv_freq``) with the model's own ``_init_weights``
     — the same path `from_pretrained` takes for them;
  5. for each experts module (forward order) register the layer with DWDP and a ``fill`` callback per
     fused weight that reads **only experts [a, b)** of this rank from safetensors (one expert at a time,
     or ``get_slice`` of a fused tensor) straight into the transport handle;
  6. ``manager.setup()`` (handle exchange, composites), then bind each experts parameter to its
     composite ``[E, ...]`` tensor (zero-copy).

Memory invariant: at no point does a rank hold more than its local experts plus one expert's
projection in flight; the safetensors files are mmapped and only the local experts' pages are touched.
A failure anywhere releases the manager's handles (``manager.setup`` rolls back; callers own ``manager``).
"""

from __future__ import annotations

import json
import logging
import pathlib
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from . import models as arch

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The model directory is missing, incomplete or inconsistent with its config."""


def read_config_json(model_dir) -> dict:
    path = pathlib.Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir}: no config.json (expected a directory written by save_pretrained; "
                              f"`dwdp-worker synth ARCH --out DIR` writes a synthetic one)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def load_config(model_dir):
    from transformers import AutoConfig

    read_config_json(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(model_dir))
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{model_dir}: cannot read the transformers config ({exc})") from None
    arch.check_supported_config(config)
    return config


class SafetensorsIndex:
    """key → file over a checkpoint's safetensors files; opens each file lazily (mmap), closes on exit."""

    def __init__(self, model_dir):
        self.dir = pathlib.Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.file_of = {k: self.dir / f for k, f in weight_map.items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{model_dir}: no *.safetensors files")
            from safetensors import safe_open

            self.file_of = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():
                        self.file_of[k] = f
        self._handles: dict[pathlib.Path, Any] = {}
        self._stack = ExitStack()

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def _handle(self, key: str):
        from safetensors import safe_open

        f = self.file_of[key]
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
        return h

    def get(self, key: str):
        return self._handle(key).get_tensor(key)

    def get_slice(self, key: str):
        return self._handle(key).get_slice(key)

    def close(self) -> None:
        self._handles.clear()
        self._stack.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


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


def build_meta_model(config, dtype):
    """The model on the meta device with the kernels ``from_pretrained`` would select."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    return model


def _set_tensor(model, name: str, value, *, buffer: bool) -> None:
    import torch

    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if buffer:
        mod._buffers[attr] = value
    else:
        mod._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)


@dataclass
class LoadReport:
    dense_bytes: int
    local_expert_bytes: int
    total_expert_bytes: int
    layers: list[int]


def load_dense(model, spec, ckpt: SafetensorsIndex, device, *, progress: bool = False) -> int:
    """Load every non-expert parameter/persistent buffer; rebuild non-persistent buffers. Returns bytes."""
    import torch

    non_persistent = {n for n, _ in model.named_non_persistent_buffers()} if hasattr(
        model, "named_non_persistent_buffers") else set()
    todo = [(n, t, False) for n, t in model.named_parameters() if not arch.is_expert_param(n)]
    todo += [(n, t, True) for n, t in model.named_buffers() if n not in non_persistent]
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    nbytes = 0
    missing = []
    from tqdm.auto import tqdm

    for name, meta, is_buffer in tqdm(todo, desc="dwdp: loading dense weights", unit="tensor", leave=False,
                                      disable=not progress):
        key = arch.to_ckpt_name(spec, name)
        if key not in ckpt:
            if name in tied:
                continue
            missing.append(key)
            continue
        value = ckpt.get(key)
        if tuple(value.shape) != tuple(meta.shape):
            raise CheckpointError(f"{key}: checkpoint shape {tuple(value.shape)} != model shape {tuple(meta.shape)} "
                                  f"(config.json does not match the weights)")
        value = value.to(device=device, dtype=meta.dtype)
        _set_tensor(model, name, value, buffer=is_buffer)
        nbytes += value.numel() * value.element_size()
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} dense tensor(s), e.g. {missing[:3]}")
    if tied:
        model.tie_weights()
    # non-persistent buffers (rotary inv_freq): empty on the device, then the model's own init
    owners = set()
    for name in non_persistent:
        buf = model.get_buffer(name)
        _set_tensor(model, name, torch.empty_like(buf, device=device), buffer=True)
        owners.add(name.rpartition(".")[0])
    with torch.no_grad():
        for owner in sorted(owners):
            module = model.get_submodule(owner)
            if any(True for _ in module.parameters(recurse=False)):
                raise arch.UnsupportedModelError(f"module {owner} mixes parameters and non-persistent buffers")
            model._init_weights(module)
    leftover = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                if t.device.type == "meta" and not arch.is_expert_param(n)]
    if leftover:
        raise CheckpointError(f"tensors left uninitialised after loading: {leftover[:5]}")
    return nbytes


def _expert_reader(spec, ckpt: SafetensorsIndex, site: arch.ExpertsSite, weight: str, progress_bar):
    """fill(view, a, b): write experts [a, b) of ``weight`` into ``view`` ([b−a, ...] on the handle's device)."""
    fused = arch.fused_ckpt_key(spec, site.name, weight)

    def fill(view, a: int, b: int) -> None:
        if fused in ckpt:
            view.copy_(ckpt.get_slice(fused)[a:b])
            progress_bar.update(b - a)
            return
        for e in range(a, b):
            keys = arch.expert_ckpt_keys(spec, site.name, weight, e)
            row = 0
            for key in keys:
                if key not in ckpt:
                    raise CheckpointError(f"checkpoint lacks expert tensor {key} (and the fused {fused})")
                t = ckpt.get(key)  # one expert's projection: the only transient copy
                n = t.shape[0]
                if row + n > view.shape[1] or tuple(t.shape[1:]) != tuple(view.shape[2:]):
                    raise CheckpointError(f"{key}: shape {tuple(t.shape)} does not fit {weight} expert "
                                          f"shape {tuple(view.shape[1:])}")
                view[e - a, row:row + n].copy_(t)
                row += n
                del t
            if row != view.shape[1]:
                raise CheckpointError(f"{weight} expert {e}: checkpoint rows {row} != {view.shape[1]}")
            progress_bar.update(1)

    return fill


def load_sharded(model_dir, manager, *, dtype=None, progress: bool = False, config=None):
    """Build the model with dense weights loaded and experts bound to DWDP composites. Runs ``manager.setup()``.

    Returns ``(model, LoadReport)``.
    """
    import torch

    model_dir = pathlib.Path(model_dir)
    config = config or load_config(model_dir)
    spec = arch.check_supported_config(config)
    dtype = resolve_dtype(config, dtype)
    device = torch.device(manager.device)
    model = build_meta_model(config, dtype)
    sites = arch.experts_sites(model)
    if not sites:
        raise arch.UnsupportedModelError(f"{spec.model_type}: the model has no fused experts module")
    a, b = manager.local_range
    with SafetensorsIndex(model_dir) as ckpt:
        dense = load_dense(model, spec, ckpt, device, progress=progress)
        from tqdm.auto import tqdm

        total_local = len(sites) * len(arch.EXPERT_WEIGHTS) * (b - a)
        local_bytes = total_bytes = 0
        with tqdm(total=total_local, desc=f"dwdp: loading local experts [{a}, {b})", unit="expert", leave=False,
                  disable=not progress) as bar:
            for site in sites:
                manager.add_layer(site.layer)
                for w in arch.EXPERT_WEIGHTS:
                    meta = site.module._parameters[w]
                    manager.add_expert_weight(site.layer, w, expert_shape=tuple(meta.shape[1:]), dtype=meta.dtype,
                                              fill=_expert_reader(spec, ckpt, site, w, bar))
                    per_expert = meta[0].numel() * meta.element_size()
                    local_bytes += (b - a) * per_expert
                    total_bytes += meta.shape[0] * per_expert
    manager.setup()
    for site in sites:
        for w in arch.EXPERT_WEIGHTS:
            composite = manager.composite(site.layer, w)
            site.module._parameters[w] = torch.nn.Parameter(composite, requires_grad=False)
    log.info("loaded %s from %s: dense %.1f MiB, local experts [%d, %d) %.1f MiB of %.1f MiB", spec.model_type,
             model_dir, dense / 2**20, a, b, local_bytes / 2**20, total_bytes / 2**20)
    return model, LoadReport(dense, local_bytes, total_bytes, [s.layer for s in sites])


def unbind_experts(model) -> None:
    """Point the expert parameters back at meta tensors (after ``manager.release()`` the composites are unmapped:
    a stray forward then fails loudly instead of reading unmapped memory)."""
    import torch

    for site in arch.experts_sites(model):
        for w in arch.EXPERT_WEIGHTS:
            p = site.module._parameters[w]
            site.module._parameters[w] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                            requires_grad=False)


def has_tokenizer(model_dir) -> bool:
    d = pathlib.Path(model_dir)
    return any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))


__all__ = ["CheckpointError", "LoadReport", "SafetensorsIndex", "load_config", "load_sharded", "read_config_json",
           "resolve_dtype", "unbind_experts", "has_tokenizer"]
