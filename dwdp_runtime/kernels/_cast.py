"""fp32 → output dtype in a kernel epilogue, round-to-nearest-even on the GPU and in the interpreter alike.

Triton's CPU interpreter (seen with triton 3.9) truncates fp32 → bf16 where the GPU rounds to nearest
even; under the interpreter (``EXACT_BF16``) the rounding is done on the bits instead, so CPU tests see
the GPU's numbers. NaN payloads are not preserved on that path (tests never produce NaN).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_out(x, dtype: tl.constexpr, EXACT_BF16: tl.constexpr):
    if EXACT_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)
