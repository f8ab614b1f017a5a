"""bench/fp4_moe.py on CPU: its smoke path end to end under Triton's interpreter (the FP4 block bitwise the bf16
block on the dequantized weights; the bytes per expert measured from the packed tensors), and its summary."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import fp4_moe  # noqa: E402


def test_smoke_run_is_bitwise_and_counts_fp4_bytes(tmp_path):
    out = tmp_path / "out.json"
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "worker"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "fp4_moe.py"), "--smoke", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["format"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"mxfp4", "nvfp4"} and all(r["block_bitwise_equal"] for r in rows.values())
    bf16 = rows["mxfp4"]["bf16_expert_bytes"]            # 2 bytes per weight
    assert rows["mxfp4"]["mxfp4_expert_bytes"] == bf16 // 4 + bf16 // 64            # + 1 byte per 32 weights
    assert rows["nvfp4"]["nvfp4_expert_bytes"] == bf16 // 4 + bf16 // 32 + 3 * 4     # + 1 per 16, 3 fp32 globals
    # W4A8 runs the CuTe kernels on CUDA: the CPU smoke run says why it skipped it (the GPU run times it)
    assert all("CUDA" in r["w4a8_skipped"] for r in rows.values())


def test_summary_is_the_median_and_range_per_row():
    def row(r1, r2):
        return dict(shape="qwen3_30b", format="nvfp4", tokens=16384, fp4_over_bf16_grouped_mm=r1,
                    fp4_block_over_bf16_block=r2)

    (entry,) = fp4_moe.summarize([[row(1.1, 0.9)], [row(1.3, 0.8)], [row(1.2, 1.0)]])
    assert entry["rounds"] == 3
    assert entry["fp4_over_bf16_grouped_mm"]["median"] == 1.2 and entry["fp4_block_over_bf16_block"]["min"] == 0.8
