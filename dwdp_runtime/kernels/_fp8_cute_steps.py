"""The mainloop and epilogue steps of ``_fp8_cute_kernel``, on one warpgroup's registers.

Plain Python run at trace time inside the kernel: CuTe DSL's preprocessor does not rewrite these functions, so
their ``for`` loops unroll and they hold no staged control flow. They take pipeline states but never advance
them — the kernel body does, because the tracer threads state only through rebinds it can see there.
The C fragment of an m64nNk32 ``wgmma`` is ((2, 2, N/8), 1, 1): elements 4j + {0, 1} lie on the thread's row
r, 4j + {2, 3} on row r + 8 — hence ``scales[(i // 2) % 2]``.
"""

import cutlass
import cutlass.cute as cute


def mma(read_state, mmas, tCrA, tCrB, scratch, num_k_blocks):
    """Issue the four wgmma of the current stage into ``scratch`` (zeroed by the first) as one commit group."""
    cute.nvgpu.warpgroup.fence()
    for kb in range(num_k_blocks):
        coord = (None, None, kb, read_state.index)
        cute.gemm(mmas[min(kb, 1)], scratch, tCrA[coord], tCrB[coord], scratch)
    cute.nvgpu.warpgroup.commit_group()


def promote(accumulators, scratch, scales):
    """``acc += scratch · scale(row)`` (row of element i: module docstring)."""
    for i in range(cute.size(accumulators)):
        accumulators[i] = accumulators[i] + scratch[i] * scales[(i // 2) % 2]


def load_scales(mSA, mSB, row_lo, row_hi, nb, second_b, k, expert, two_b):
    """K step ``k``'s scales of a tile: the activation scales of this thread's two rows and the weight scale of
    each B tile (``(a_lo, a_hi, w_s, w_u)``; ``w_u`` is the second B tile's, or ``w_s`` with one)."""
    a_lo, a_hi, w_s = mSA[(row_lo, k)], mSA[(row_hi, k)], mSB[(nb, k, expert)]
    return a_lo, a_hi, w_s, mSB[(nb + second_b, k, expert)] if two_b else w_s


def scale_products(a_lo, a_hi, w_s, w_u):
    """The promotion's per-row factors ``s_a · s_w`` for each B tile (``scales[(i // 2) % 2]``: row r, r + 8)."""
    return (a_lo * w_s, a_hi * w_s), (a_lo * w_u, a_hi * w_u)


def act_mul_amax(gate, up, glu=None):
    """``gate ← silu(gate) · up`` element-wise (fp32); returns the thread's |·| max on its two rows. ``glu`` (a
    ``gates.ClampedGlu``, its fields compiled in as constants): the clamped SwiGLU instead,
    ``g · sigmoid(alpha · g) · (u + up_shift)`` on ``g = min(gate, limit)``, ``u = clamp(up, −limit, limit)``
    (DeepSeek-V4's limit 10, alpha 1, no shift), as the Triton kernels' ``grouped_gemm._glu``.

    ``silu(g) = g · rcp(1 + exp(-g))`` with the SFU's approximate reciprocal (≤ 1 ulp; the exp is the SFU's
    already): an IEEE division per element is a ~10-instruction sequence, and with the requantisation's it made
    the fused epilogue cost 20 % of GEMM 1 at Qwen3's K = 2048 (H200). g → -∞ gives rcp(∞) = 0, g · 0 = -0 as
    the division did. The clamp adds two or three min/max per element, no division."""
    amax = [cutlass.Float32(0.0), cutlass.Float32(0.0)]
    for i in range(cute.size(gate)):
        g = gate[i]
        u = up[i]
        if cutlass.const_expr(glu is not None):
            limit, alpha, up_shift = glu.limit, glu.alpha, glu.up_shift
            g = cute.arch.fmin(g, cutlass.Float32(limit))
            u = cute.arch.fmax(cute.arch.fmin(u, cutlass.Float32(limit)), cutlass.Float32(-limit))
            sigmoid = cute.arch.rcp_approx(1.0 + cute.arch.exp(g * cutlass.Float32(-alpha)))
            h = g * sigmoid * (u + cutlass.Float32(up_shift))
        else:
            h = g * cute.arch.rcp_approx(1.0 + cute.arch.exp(-g)) * u
        gate[i] = h
        amax[(i // 2) % 2] = cute.arch.fmax(amax[(i // 2) % 2], cute.arch.fmax(h, -h))
    return amax[0], amax[1]


def divide_rows(acc, s_lo, s_hi):
    """``acc · (1 / scale(row))`` before the e4m3 conversion: one correctly rounded division per row, then a
    multiply per element. ``fp8_quant`` divides each element; the two differ by at most 1 ulp of fp32, which moves
    an e4m3 code only when the value sits within that ulp of a rounding boundary of e4m3's 3-bit mantissa (an
    fp32 ulp is 2⁻²⁰ of an e4m3 step: by that arithmetic about 2 values in a million, not counted; the GPU tests
    bound the codes that differ from the torch reference at 1 %)."""
    inv = (1.0 / s_lo, 1.0 / s_hi)
    for i in range(cute.size(acc)):
        acc[i] = acc[i] * inv[(i // 2) % 2]


def acquire(ring, state, timed=False):
    """The producer's wait for a free stage (and its arming with the stage's TMA bytes); ``timed``: returns the
    cycles it waited (the trace build), else 0."""
    start = cute.arch.clock64() if timed else 0
    ring.producer_acquire(state)
    return cute.arch.clock64() - start if timed else 0


def wait_stage(ring, read_state, timed=False):
    """A math warpgroup's wait for the next K step's stage; ``timed``: returns the cycles it waited, else 0."""
    start = cute.arch.clock64() if timed else 0
    ring.consumer_wait(read_state)
    return cute.arch.clock64() - start if timed else 0


def issue(ring, read_state, mmas, tCrA, tCrB, scratch, num_k_blocks, timed=False):
    """Wait for the next K step's stage and issue its four wgmma into ``scratch`` (zeroed by the first; the
    caller advances ``read_state`` — the tracer threads state only through rebinds in the kernel body).
    ``timed``: returns the cycles spent waiting for the stage (the trace build), else 0."""
    waited = wait_stage(ring, read_state, timed)
    mma(read_state, mmas, tCrA, tCrB, scratch, num_k_blocks)
    return waited


def wait_mma(timed=False):
    """Wait for this warpgroup's wgmma; ``timed``: returns the cycles it took (the trace build), else 0."""
    start = cute.arch.clock64() if timed else 0
    cute.nvgpu.warpgroup.wait_group(0)
    return cute.arch.clock64() - start if timed else 0


def retire(ring, release_state, accumulators, scratch, scales, timed=False):
    """Wait for the step's wgmma, free its stage (the caller advances ``release_state``), and promote;
    ``timed``: returns the cycles of the wait (the trace build), else 0."""
    waited = wait_mma(timed)
    ring.consumer_release(release_state)
    promote(accumulators, scratch, scales)
    return waited


def finish_step(ring, read_state, release_state, mmas, tCrA, tCrB2, accumulators, accumulators2, scratch, scales,
                scales2, num_k_blocks, two_b, timed=False):
    """A K step whose first MMA was issued (``issue``): wait for it and promote; with two B tiles (``two_b``) issue
    the second tile's MMA through the same scratch, wait, promote into ``accumulators2``; free the stage. The
    caller advances both states. ``timed``: returns the cycles spent waiting for the MMAs (the trace build)."""
    if two_b:
        waited = wait_mma(timed)
        promote(accumulators, scratch, scales)
        mma(read_state, mmas, tCrA, tCrB2, scratch, num_k_blocks)
        return waited + retire(ring, release_state, accumulators2, scratch, scales2, timed)
    return retire(ring, release_state, accumulators, scratch, scales, timed)
