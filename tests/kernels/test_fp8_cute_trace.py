"""The CuTe GEMM's trace build, the CPU half: ``fp8_cute_trace.phase_shares`` turns its per-CTA, per-role
SM-cycle counters into the share of each role's cycles spent waiting and in the epilogue (the counters themselves
come from the GPU: ``bench/fp8_moe.py --trace``; that the build compiles: ``test_fp8_cute_compile.py``)."""

from __future__ import annotations

import pytest
import torch

from dwdp_runtime.kernels import fp8_cute_trace


def _counters(rows):
    """``[CTAs, roles, fields]`` from ``{(cta, role): (cycles, stage_wait, mma_wait, epilogue, tiles)}``; CTAs past
    the grid stay zero, as the kernel leaves them."""
    t = torch.zeros(4, fp8_cute_trace.TRACE_ROLES, len(fp8_cute_trace.TRACE_FIELDS), dtype=torch.int64)
    for (cta, role), values in rows.items():
        t[cta, role] = torch.tensor(values)
    return t


def test_shares_are_summed_over_the_ctas_that_ran():
    counters = _counters({
        (0, 0): (1000, 600, 0, 0, 3), (1, 0): (3000, 1400, 0, 0, 5),  # producer: 2000 of 4000 waiting
        (0, 1): (1000, 100, 200, 300, 3), (1, 1): (3000, 300, 600, 900, 5),
        (0, 2): (2000, 0, 1000, 500, 3), (1, 2): (2000, 400, 1000, 500, 5),
    })
    shares = fp8_cute_trace.phase_shares(counters)
    assert list(shares) == list(fp8_cute_trace.TRACE_ROLE_NAMES)
    assert shares["producer"]["stage_wait"] == pytest.approx(0.5)
    assert shares["math warpgroup 1"] == pytest.approx(
        {"stage_wait": 0.1, "mma_wait": 0.2, "epilogue": 0.3, "tiles_per_cta": 4.0})
    assert shares["math warpgroup 2"]["mma_wait"] == pytest.approx(0.5)
    assert shares["math warpgroup 2"]["stage_wait"] == pytest.approx(0.1)
    # the two CTAs past the grid (all zero) count neither in the sums nor in tiles per CTA
    assert shares["producer"]["tiles_per_cta"] == pytest.approx(4.0)


def test_a_trace_that_ran_nothing_reads_as_zero_shares():
    shares = fp8_cute_trace.phase_shares(_counters({}))
    assert all(v == 0.0 for role in shares.values() for v in role.values())



def test_the_sm_clock_is_the_longest_roles_cycles_over_the_wall():
    counters = _counters({(0, 0): (1_500_000, 0, 0, 0, 1), (1, 2): (1_600_000, 0, 0, 0, 1)})
    assert fp8_cute_trace.sm_clock_hz(counters, 1e-3) == pytest.approx(1.6e9)
    assert fp8_cute_trace.sm_clock_hz(counters, 0.0) == 0.0
