"""The W4A8 re-encoding kernel (``kernels.fp4_fp8``) compiles for sm_90 on a machine without a GPU (CI): both
scale formats, the GPU's decode (``FAST``: packed bf16 decode, hardware e4m3 conversion — round to nearest even,
saturating) and the generic one, with no local-memory spills. Its bytes are checked against torch under the
interpreter (tests/kernels/test_fp4_fp8.py) and on the GPU (tests/gpu/test_w4a8_gpu.py).

Compiled in a subprocess: this folder's conftest turns Triton's interpreter on at collection, and a kernel
defined under it cannot be compiled for a GPU.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("a GPU machine compiles for its own GPU: tests/gpu/test_w4a8_gpu.py", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROGRAM = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dwdp_runtime.kernels import fp4_fp8

kernel = fp4_fp8._fp4_fp8_kernel
ints = ["N", "K", "split", "s2_second", "stride_we", "stride_wn", "stride_wk", "stride_se", "stride_sn", "stride_sk",
        "stride_s2e", "stride_s2s", "stride_qe", "stride_qn", "stride_qse", "stride_qsn"]
signature = {"w_ptr": "*u8", "s_ptr": "*u8", "s2_ptr": "*fp32", "q_ptr": "*u8", "qs_ptr": "*fp32",
             **{name: "i32" for name in ints},
             **{name: "constexpr" for name in ("SCALE_FMT", "HAS_S2", "BLOCK_", "SUB", "FAST")}}
out = []
for fmt, has_s2 in ((0, False), (1, True)):
    for fast in (True, False):
        constexprs = {"SCALE_FMT": fmt, "HAS_S2": has_s2, "BLOCK_": fp4_fp8.FP8_SCALE_BLOCK, "SUB": fp4_fp8.SUB_ROWS,
                      "FAST": fast}
        ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        out.append({"fmt": fmt, "fast": fast, "cvt": "cvt.rn.satfinite.e4m3x2.f32" in ptx, "local": ".local" in ptx})
print(json.dumps(out))
"""


def test_reencode_kernel_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("no ptxas to compile for sm_90 here")
    assert proc.returncode == 0, proc.stderr[-3000:]
    variants = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(variants) == 4
    for v in variants:
        assert v["cvt"] == v["fast"], v       # the hardware conversion where it runs, the integer encode elsewhere
        assert not v["local"], v              # no register spills
