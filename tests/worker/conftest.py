"""Fixtures for the worker tests: one synthetic checkpoint per architecture per session.

The repository root and ``worker/`` go first on ``sys.path`` so this checkout's packages are imported
(also by ``spawn``ed rank processes, which inherit ``sys.path``).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from dwdp_worker.checkpoint.synth import SUPPORTED_ARCHS, write_synthetic  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Tiny checkpoints (8 experts, 3 layers incl. a dense one where the arch has them): one float32 per arch,
    plus ``qwen3_moe_bf16`` (bfloat16) and ``qwen3_moe_fused`` (experts stored as fused 3-D tensors)."""
    base = tmp_path_factory.mktemp("ckpt")
    out = {a: write_synthetic(a, base / a, seed=7, tokenizer=(a == "qwen3_moe")) for a in SUPPORTED_ARCHS}
    out["qwen3_moe_bf16"] = write_synthetic("qwen3_moe", base / "qwen3_moe_bf16", seed=11, dtype="bfloat16")
    out["qwen3_moe_fused"] = fuse_experts(out["qwen3_moe"], base / "qwen3_moe_fused")
    return out


def fuse_experts(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """Rewrite a per-expert checkpoint with fused ``experts.gate_up_proj``/``down_proj`` tensors."""
    import re
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    out, experts = {}, {}
    for k, v in tensors.items():
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", k)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = v
        else:
            out[k] = v
    for prefix, per in experts.items():
        ids = sorted(per)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in ids])
        out[f"{prefix}.down_proj"] = torch.stack([per[e]["down_proj"] for e in ids])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def tiny_api_model_dir(tmp_path_factory):
    """The tiny tokenized qwen3_moe checkpoint the HTTP API tests serve (written once per session)."""
    from dwdp_worker.checkpoint.synth import write_synthetic

    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ckpt") / "m", seed=3, tokenizer=True,
                           max_positions=64)


@pytest.fixture(scope="module")
def model_dir(tiny_api_model_dir):
    return tiny_api_model_dir
