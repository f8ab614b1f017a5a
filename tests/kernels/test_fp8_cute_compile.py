"""The CuTe DSL FP8 kernels compile for sm_90a on a machine without a GPU (CI): the plain block-scaled grouped
GEMM (clusters of 1 and 2, 64-, 128- and 256-column tiles) and the fused gate_up (SiLU, and DeepSeek-V4's clamped
SwiGLU) — with no register spills;
the host-side tile checks (a wide tile where N is not a multiple of it falls back to 128 columns); and a kernel
that fails to build is recorded and named (``CuteBuildError``, ``unavailable()``).

CuTe DSL lowers to PTX and runs ptxas in-process; ``CUTE_DSL_ARCH`` names the target where no GPU can be
asked. Their numbers (results, speed) are checked on H200: tests/gpu/test_fp8_cute_gpu.py, bench/fp8_moe.py.
Skipped where nvidia-cutlass-dsl is not installed (``pip install -e '.[sm-gather]'``).
"""

from __future__ import annotations

import os
import re
import struct

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("a GPU machine compiles for its own GPU: tests/gpu/test_fp8_cute_gpu.py", allow_module_level=True)
# CuTe DSL reads the target when it is imported: name sm_90a before the import (no GPU to ask here)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass.cute", reason="nvidia-cutlass-dsl is not installed")
fp8_cute = pytest.importorskip("dwdp_runtime.kernels.fp8_cute")
from dwdp_runtime.kernels.gates import ClampedGlu  # noqa: E402


def _compile(act_inter: int, tile_n: int, cluster_n: int, capfd, dump_dir, trace: bool = False,
             glu=None):
    """Compile one build; returns ptxas's report (captured) and the PTX (written under ``dump_dir``, never the
    working directory)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    e, hidden, rows = 4, 512, 512
    n = 2 * act_inter if act_inter else 512
    a = torch.zeros(rows, hidden, dtype=torch.float8_e4m3fn)
    sa = torch.zeros(hidden // 128, rows)
    w = torch.zeros(e, n, hidden, dtype=torch.float8_e4m3fn)
    ws = torch.zeros(e, n // 128, hidden // 128)
    if act_inter:
        d, ds = torch.zeros(rows, act_inter, dtype=torch.float8_e4m3fn), torch.zeros(act_inter // 128, rows)
    else:
        d, ds = torch.zeros(rows, n, dtype=torch.bfloat16), sa
    counters = torch.zeros(132, fp8_cute.TRACE_ROLES, len(fp8_cute.TRACE_FIELDS), dtype=torch.int64) if trace else None
    args = fp8_cute.gemm_arguments(a, sa, w, ws, d, ds, torch.zeros(rows // 128, dtype=torch.int32), counters)
    kernel = fp8_cute._kernel_module().BlockScaledGroupedGemm(hidden // 128, tile_n, False, 1, cluster_n, act_inter,
                                                              trace, glu)
    compiled = cute.compile(kernel.from_pointers, *args, n, d.shape[1], 132 // cluster_n, make_fake_stream(),
                            options=f"--remarks{{ptx}} --keep-ptx --dump-dir={dump_dir}")
    assert compiled is not None
    return capfd.readouterr(), compiled.__ptx__


def _ptx_f32(x: float) -> str:
    """A float32 immediate as PTX writes it (``0f41200000`` is 10.0)."""
    return "0f" + struct.pack(">f", x).hex().upper()


#: DeepSeek-V4's clamped silu, compiled into the fused gate_up's epilogue
DEEPSEEK_V4_GLU = ClampedGlu(10.0)


@pytest.mark.parametrize("act_inter, tile_n, cluster_n, glu", [(0, 128, 1, None), (0, 128, 2, None), (0, 64, 2, None),
                                                                (0, 256, 2, None), (256, 128, 2, None),
                                                                (256, 128, 2, DEEPSEEK_V4_GLU)],
                         ids=["plain-c1", "plain-c2", "plain-n64", "plain-n256", "fused-gate-up",
                              "fused-gate-up-clamped"])
def test_cute_fp8_kernels_compile_for_sm90_without_spills(act_inter, tile_n, cluster_n, glu, capfd, tmp_path):
    out, ptx = _compile(act_inter, tile_n, cluster_n, capfd, tmp_path, glu=glu)
    # the clamp is in the build that asks for it, and only there: min(gate, limit), max(min(up, limit), −limit)
    limit = DEEPSEEK_V4_GLU.limit
    clamp_min = re.findall(rf"min\.f32\s+%r\d+, %r\d+, {_ptx_f32(limit)};", ptx)
    clamp_max = re.findall(rf"max\.f32\s+%r\d+, %r\d+, {_ptx_f32(-limit)};", ptx)
    if glu is None:
        assert not clamp_min and not clamp_max
    else:
        assert clamp_min and len(clamp_min) == 2 * len(clamp_max), (len(clamp_min), len(clamp_max))
    text = out.out + out.err
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    assert spills, "ptxas reported no resource usage"
    assert all(s == ("0", "0") for s in spills), spills
    # every wgmma stays asynchronous (a serialised pipeline is reported as C7514/C7515/…)
    assert "wgmma.mma_async instructions are serialized" not in text
    # and no wait for one is injected (C7517: a wgmma issued on one branch only, waited for where branches join)
    assert "warpgroup.wait is injected" not in text


@pytest.mark.parametrize("act_inter, tile_n", [(256, 128), (0, 256)], ids=["fused-gate-up", "plain-n256"])
def test_the_trace_build_compiles(act_inter, tile_n, capfd, tmp_path):
    """The diagnostic build with phase counters (``trace=True``: clock reads around each wait and the epilogue) compiles
    for sm_90a; what it measures is read on the GPU (``bench/fp8_moe.py --trace``). Its clock reads may cost registers,
    so only the build is asserted, not the absence of spills."""
    out, _ = _compile(act_inter, tile_n, 2 if act_inter else 1, capfd, tmp_path, trace=True)
    assert "ptxas" in out.out + out.err


def test_wide_tile_falls_back_where_n_is_not_a_multiple_of_it():
    a = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    w = torch.zeros(2, 384, 512, dtype=torch.float8_e4m3fn)
    cfg = fp8_cute._check_operands(a, w, 384, fp8_cute.CuteGemmConfig(tile_n=256, cluster_n=2))
    assert (cfg.tile_n, cfg.cluster_n) == (128, 1)  # 3 column tiles of 128: no pairs either
    w = torch.zeros(2, 1024, 512, dtype=torch.float8_e4m3fn)
    cfg = fp8_cute._check_operands(a, w, 1024, fp8_cute.CuteGemmConfig(tile_n=256, cluster_n=2))
    assert (cfg.tile_n, cfg.cluster_n) == (256, 2)


BUILD_FAILURE_SCRIPT = """
import torch
from cutlass.cute.runtime import make_fake_stream
from dwdp_runtime.kernels import fp8_cute

rows, hidden, n, e = 256, 512, 256, 2
a = torch.zeros(rows, hidden, dtype=torch.float8_e4m3fn)
sa = torch.zeros(hidden // 128, rows)
w = torch.zeros(e, n, hidden, dtype=torch.float8_e4m3fn)
ws = torch.zeros(e, n // 128, hidden // 128)
d = torch.zeros(rows, n, dtype=torch.bfloat16)
args = fp8_cute.gemm_arguments(a, sa, w, ws, d, sa, torch.zeros(rows // 128, dtype=torch.int32))
for attempt in range(2):
    try:
        fp8_cute.compile_gemm(hidden // 128, fp8_cute.PLAIN_CONFIG, 0, args, n, n, 132, make_fake_stream())
        print("BUILT")
    except fp8_cute.CuteBuildError as exc:
        print("ERROR", exc)
print("UNAVAILABLE", fp8_cute.unavailable())
"""


def test_a_kernel_that_fails_to_build_is_recorded_once_and_named(tmp_path):
    """A real build failure (the sm_90a kernel compiled for sm_100a: CuTe DSL refuses its wgmma) raises
    CuteBuildError with the compiler's reason, logs one warning however often it is retried, and makes
    ``unavailable()`` name it — what turns the ``auto`` backend to the Triton kernels (tests/gpu covers that
    fallback end to end)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a",
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", BUILD_FAILURE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    errors = [line for line in lines if line.startswith("ERROR")]
    assert len(errors) == 2 and all("expects arch to be sm_90a" in line for line in errors), proc.stdout
    assert "BUILT" not in proc.stdout
    (unavailable,) = [line for line in lines if line.startswith("UNAVAILABLE")]
    assert "failed to build" in unavailable and "sm_90a" in unavailable
    assert proc.stderr.count("the CuTe FP8 kernels failed to build") == 1, proc.stderr[-3000:]
