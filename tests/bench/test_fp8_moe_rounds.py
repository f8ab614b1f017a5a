"""bench/fp8_moe.py --rounds: each ratio's median and range over rounds (CPU: the summary itself, and the script's
own smoke path under Triton's interpreter end to end)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import fp8_moe  # noqa: E402


def _row(tokens, **ratios):
    return dict(shape="deepseek_v3", tokens=tokens, **ratios)


def test_summary_is_the_median_and_range_of_each_ratio_per_row():
    rounds = [[_row(4096, cute_block_over_bf16_block=0.70, fp8_over_bf16_tflops=1.1), _row(16384, cute_over_bf16_tflops=1.40)],
              [_row(4096, cute_block_over_bf16_block=0.62, fp8_over_bf16_tflops=1.3), _row(16384, cute_over_bf16_tflops=1.50)],
              [_row(4096, cute_block_over_bf16_block=0.65, fp8_over_bf16_tflops=1.2), _row(16384, cute_over_bf16_tflops=1.45)]]
    small, large = fp8_moe.summarize_rounds(rounds)
    assert small["rounds"] == 3 and small["tokens"] == 4096
    assert small["cute_block_over_bf16_block"] == dict(median=0.65, min=0.62, max=0.70)
    assert small["fp8_over_bf16_tflops"]["median"] == pytest.approx(1.2)
    assert "cute_over_bf16_tflops" not in small  # a ratio no round measured is left out, not invented
    assert large["cute_over_bf16_tflops"] == dict(median=1.45, min=1.40, max=1.50)


def test_rounds_that_disagree_on_their_rows_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        fp8_moe.summarize_rounds([[_row(4096)], [_row(16384)]])


def _smoke(tmp_path, *flags) -> dict:
    out = tmp_path / "out.json"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp8_moe.py"), "--smoke", *flags,
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_smoke_run_with_two_rounds_writes_the_summary(tmp_path):
    result = _smoke(tmp_path, "--rounds", "2")
    assert len(result["rows"]) == 2
    (entry,) = result["summary"]
    assert entry["rounds"] == 2 and entry["shape"] == "tiny"
    assert set(entry) >= {"fp8_over_bf16_tflops", "fp8_block_over_bf16_block"}


def test_no_triton_skips_the_triton_kernels_and_keeps_the_bf16_references(tmp_path):
    (row,) = _smoke(tmp_path, "--no-triton")["rows"]
    assert {"bf16_grouped_mm_ms", "bf16_block_ms"} <= set(row)
    assert not any(key.startswith("fp8_") for key in row)
