"""`dwdp plan` CLI contract, the PNG sweep, no-torch import, and calibration arithmetic."""

import json
import os
import subprocess
import sys

import pytest

from dwdp_runtime.cli import main
from dwdp_runtime.planner.calibration import H200_MEASURED, calibrate, format_report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {"t_compute_us", "t_prefetch_us", "t_dwdp_us", "t_dep_us", "speedup", "crossover_isl", "memory_gib",
        "recommended"}


def test_json_contract(capsys):
    rc = main(["plan", "--model", "qwen3-235b-a22b", "--dtype", "fp8", "--isl", "4096", "--batch", "2",
               "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    obj = json.loads(out)  # exactly one object
    assert KEYS <= obj.keys()
    assert obj["speedup"] == pytest.approx(obj["t_dep_us"] / obj["t_dwdp_us"])
    assert obj["t_dwdp_us"] == pytest.approx(max(obj["t_compute_dwdp_us"], obj["t_prefetch_us"]))
    assert {"dense_weights", "local_experts", "pool_slots", "kv_cache_available"} <= obj["memory_gib"].keys()
    assert (obj["isl"], obj["batch"], obj["experts_per_worker"], obj["prefetch_stride"]) == (4096, 2, 32, 32)


def test_table_output(capsys):
    assert main(["plan", "--model", "mixtral-8x22b", "--dtype", "fp8", "--dwdp-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "T_DWDP" in out and "speedup" in out and "recommended" in out


def test_hf_config_path(tmp_path, capsys):
    cfg = {"hidden_size": 256, "num_hidden_layers": 4, "num_experts": 16, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 1000, "decoder_sparse_step": 1, "mlp_only_layers": []}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "--json", "--dwdp-size", "2"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["remote_experts_per_layer"] == 8


@pytest.mark.parametrize("argv,needle", [
    (["--model", "no-such-model"], "neither a preset"),
    (["--model", "deepseek-r1", "--hardware", "tpu-v9"], "unknown hardware preset"),
    (["--model", "deepseek-r1", "--dtype", "int3"], "unknown dtype"),
    (["--model", "deepseek-r1", "--experts-per-worker", "8", "--prefetch-stride", "8"], "coverage rule"),
    (["--model", "deepseek-r1", "--prefetch-slots", "1"], "slots"),
    (["--model", "deepseek-r1", "--isl", "0"], "isl=0"),
    (["--model", "/nonexistent/config.json"], "neither a preset"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys):
    assert main(["plan", *argv, "--json"]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in cap.err


def test_bad_config_json_exits_2(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert main(["plan", "--model", str(tmp_path / "config.json")]) == 2
    assert "missing" in capsys.readouterr().err


def test_sweep_writes_png(tmp_path, capsys):
    png = tmp_path / "fig3.png"
    rc = main(["plan", "--model", "deepseek-r1", "--dtype", "nvfp4", "--hardware", "gb200-nvl72", "--json",
               "--sweep", str(png), "--sweep-batches", "1,4"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["speedup"] > 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 500 and height > 200


def test_console_entry_runs_without_torch():
    code = ("import sys; from dwdp_runtime.cli import main; rc = main(['plan', '--model', 'qwen3-235b-a22b', "
            "'--json']); assert 'torch' not in sys.modules and 'matplotlib' not in sys.modules; sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model"] == "Qwen3-235B-A22B"


def test_calibration_against_hardware_md():
    res = calibrate(H200_MEASURED)
    gg, cp = res["items"]
    # grouped GEMM: F = 2*8192*2048*1024 = 34.36 GFLOP -> 34.7 µs at 989.5 TFLOP/s; bytes =
    # 8192*2048*2 + 64*2048*1024*2 + 8192*1024*2 = 318,767,104 -> 66.4 µs at 4.8 TB/s: memory-bound
    assert gg["bound"] == "memory"
    assert gg["predicted_s"] == pytest.approx(318_767_104 / 4.8e12)
    assert gg["error"]["vs_fastest"] == pytest.approx(318_767_104 / 4.8e12 / 0.11e-3 - 1)
    assert gg["measured_tflops"] == pytest.approx([2 * 8192 * 2048 * 1024 / 0.15e-3 / 1e12,
                                                   2 * 8192 * 2048 * 1024 / 0.11e-3 / 1e12])
    # copy: 2 GiB at 450 GB/s * 388/450 = 388 GB/s
    assert cp["predicted_s"] == pytest.approx(2 * 2 ** 30 / 388e9)
    assert cp["error"]["vs_slowest"] == pytest.approx(0.0, abs=1e-12)
    assert "error" in format_report(res)


def test_calibrate_cli(capsys, tmp_path):
    assert main(["plan", "--model", "deepseek-r1", "--calibrate"]) == 0
    assert "grouped_mm" in capsys.readouterr().out
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"hardware": "h200", "copy": [{"nbytes": 1e9, "bytes_per_s": 400e9}]}))
    assert main(["plan", "--model", "deepseek-r1", "--calibrate", str(f), "--json"]) == 0
    item = json.loads(capsys.readouterr().out)["items"][0]
    assert item["error"]["vs_mid"] == pytest.approx(400 / 388 - 1)


def test_sweep_batches_default_is_the_sweep_modules():
    import argparse

    from dwdp_runtime.planner import cli as plan_cli
    from dwdp_runtime.planner.sweep import DEFAULT_BATCHES

    parser = argparse.ArgumentParser()
    plan_cli.add_subparser(parser.add_subparsers())
    args = parser.parse_args(["plan", "--model", "deepseek-r1"])
    assert tuple(int(b) for b in args.sweep_batches.split(",")) == DEFAULT_BATCHES
