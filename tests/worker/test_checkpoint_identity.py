"""A checkpoint's identity (what a replacement rank must match to join a running elastic group): the same files give
the same digest wherever they are mounted; another model, another config or other weights give another."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("ident") / "q", seed=7, num_experts=8)


def test_the_same_files_anywhere_have_one_digest_and_another_model_another(ckpt, tmp_path):
    from dwdp_worker.checkpoint.identity import checkpoint_digest
    from dwdp_worker.checkpoint.synth import write_synthetic

    same = shutil.copytree(ckpt, tmp_path / "elsewhere")
    assert checkpoint_digest(same) == checkpoint_digest(ckpt)
    other_seed = write_synthetic("qwen3_moe", tmp_path / "seed8", seed=8, num_experts=8)
    assert checkpoint_digest(other_seed) != checkpoint_digest(ckpt)


def test_a_config_edit_or_changed_weights_change_the_digest(ckpt, tmp_path):
    from dwdp_worker.checkpoint.identity import SAMPLE_BYTES, checkpoint_digest

    base = checkpoint_digest(ckpt)
    cfg = shutil.copytree(ckpt, tmp_path / "cfg")
    c = json.loads((cfg / "config.json").read_text())
    c["rms_norm_eps"] = c.get("rms_norm_eps", 1e-6) * 2
    (cfg / "config.json").write_text(json.dumps(c))
    assert checkpoint_digest(cfg) != base
    for where in ("head", "tail"):
        w = shutil.copytree(ckpt, tmp_path / where)
        shard = sorted(w.glob("*.safetensors"))[0]
        raw = bytearray(shard.read_bytes())
        at = len(raw) - SAMPLE_BYTES // 2 if where == "tail" else int.from_bytes(raw[:8], "little") + 8 + 16
        raw[at] ^= 0xFF                              # one byte of tensor data inside a sampled window
        shard.write_bytes(bytes(raw))
        assert checkpoint_digest(w) != base, where
