"""bench/fp8_prefill.py --train-steps on CPU: a tiny model trained on real text (bytes), quantized, served by a
d = 2 group and compared on held-out prompts; the trained checkpoint keeps the synth layout."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for p in (ROOT / "worker", ROOT):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

pytest.importorskip("transformers")

TINY = ["--device", "cpu", "--isl", "64", "--hidden-size", "256", "--moe-intermediate-size", "128",
        "--num-experts", "8", "--num-layers", "2", "--vocab-size", "512", "--prompts", "20", "--iters", "1",
        "--dwdp-size", "2"]


def _layout(model_dir: pathlib.Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def test_trained_model_end_to_end(tmp_path):
    from bench.fp8_prefill import main, parse_args, synth_checkpoint

    out = tmp_path / "out.json"
    # the worker's own sources: a small real-text corpus, fast to read
    assert main(TINY + ["--work-dir", str(tmp_path), "--corpus", str(ROOT / "worker"), "--train-steps", "12",
                        "--train-batch", "4", "--train-seq", "128", "--profile", "--host-profile", "--fp8-dense",
                        "--json", str(out)]) == 0
    r0 = json.loads(out.read_text())["0"]
    t = r0["training"]
    assert t["steps"] == 12 and t["heldout_bits_per_byte"] < t["heldout_bits_per_byte_before"] - 1.0
    assert r0["prompt_source"].startswith("held-out byte windows")
    # on CPU the sharded FP8 model computes on the dequantized weights: exactly the reference (as the bf16 path),
    # its dense linears too, which --fp8-dense keeps FP8 on the ranks (dequantized per forward on CPU)
    assert r0["top1_agreement"] == 1.0 and r0["max_abs_dlogprob"] == 0.0
    assert r0["report"]["fp8_linears"] > 0
    assert "DWDP_FP8_DENSE" not in os.environ  # set in the rank processes only: later tests' ranks must not inherit it
    # --profile: one forward of each kind under torch.profiler, its table naming the ops that ran
    for kind in ("sharded_fp8", "unsharded_fp8"):
        prof = r0["profile"][kind]
        assert prof["wall_s"] > 0 and "aten::" in prof["table"], prof
        lo, hi = r0[f"{kind}_range_s"]
        assert 0 < lo <= r0[f"{kind}_s"] <= hi
        # --host-profile: three forwards under cProfile, the listing naming the packed forward they ran
        assert "packed_logits" in r0["host_profile"][kind] and "tottime" in r0["host_profile"][kind]
    trained = next(tmp_path.glob("*-T12-B4-S128-*-bf16"))
    untrained = synth_checkpoint(parse_args(TINY), tmp_path / "untrained", None)
    assert _layout(trained) == _layout(untrained)
