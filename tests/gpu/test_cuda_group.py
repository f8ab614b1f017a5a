"""Real DWDP groups on CUDA: several processes, posix_fd handles over Unix sockets, a real TCPStore."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _run(world, **kw):
    from ..runtime.group import run_group
    from .gpu_workloads import gpu_composite_program

    results = run_group(gpu_composite_program, world, timeout_s=240, **kw)
    errors = {r: v for r, (status, v) in results.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {r}: {v}" for r, v in errors.items())
    return {r: v for r, (_, v) in results.items()}


def _assert_steady(out):
    steady = out["steady"]
    assert steady["torch_allocations"] == 0 and steady["torch_segments"] == 0, steady
    assert all(v == 0 for v in steady["backend_calls"].values()), steady
    assert steady["synchronize"] == 0, steady


@pytest.mark.parametrize("transfer,contention_opt", [
    ("copy_engine", False), ("copy_engine", True), ("batched", False), ("batched", True),
    ("sm_gather", False), ("sm_gather", True)])
def test_three_processes_one_gpu(transfer, contention_opt):
    """N=16, d=3 → k=6, s=5: overlapping ranges, a straddling expert (6·192 KiB is not 2 MiB-aligned)."""
    if transfer == "sm_gather":
        try:
            import cutlass.cute  # noqa: F401  (nvidia-cutlass-dsl: the sm_gather kernel)
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"sm_gather needs nvidia-cutlass-dsl, not importable here ({type(exc).__name__}: {exc})")
    outs = _run(3, num_experts=16, k=6, s=5, layers=8, forwards=4, transfer=transfer,
                contention_opt=contention_opt)
    for rank, out in outs.items():
        assert out["backend"] == "cuda/posix_fd"
        assert out["restarts"] == 0
        assert out["grouped_mm"]["_grouped_mm"] is True, out["grouped_mm"]
        assert out["grouped_mm"]["F.grouped_mm"] in (True, None), out["grouped_mm"]
        _assert_steady(out)
        # 4 + 3 + 1 checked forwards × 8 layers × 2 weights
        assert out["checks"] == (4 + 3 + 1) * 8 * 2, out["checks"]
        assert out["stats"]["remote_bytes_per_forward"] > 0
    print({r: (o["local_range"], round(o["steady"]["bind_us"], 1)) for r, o in outs.items()})


def test_skipped_layer_restarts_and_stays_correct():
    outs = _run(2, num_experts=8, k=4, s=4, layers=5, forwards=3, skip=(1, 2), race_forwards=1,
                transfer="copy_engine")
    for out in outs.values():
        assert out["restarts"] >= 1
        _assert_steady(out)


def test_two_processes_two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs (kind nvidia-h200-x2); {torch.cuda.device_count()} visible")
    outs = _run(2, num_experts=16, k=8, s=8, layers=8, forwards=4, devices=[0, 1], transfer="copy_engine",
                contention_opt=True)
    assert {o["device"] for o in outs.values()} == {"cuda:0", "cuda:1"}
    for out in outs.values():
        _assert_steady(out)
        assert out["grouped_mm"]["_grouped_mm"] is True
