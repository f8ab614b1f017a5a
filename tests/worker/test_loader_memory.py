"""A rank never materialises all experts: peak RSS growth of ``Engine.build`` is bounded by its local share.

Checkpoint: Qwen3-MoE, 16 experts x 4 MoE layers, experts ~96 MiB in all (dense ~2 MiB). With d=4 each rank
owns 4 experts per layer (24 MiB). The peak is the kernel's high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) around the whole build: meta model, dense load, local-expert load into the
transport handles, handle exchange and composite mapping. It counts every anonymous page and every file
or memfd page mapped while touched, so a loader that materialised the experts (or read them through an mmap)
would show. The transport maps one (layer, weight) handle at a time while it is filled and then unmaps it:
what the rank owns in the end is its peak process growth plus its local handles (the local share).
"""

from __future__ import annotations

import pytest

from tests.runtime.group import run_group
from tests.worker.programs import memory_program

from dwdp_worker.synth import write_synthetic

MiB = 2**20


@pytest.fixture(scope="module")
def big_experts(tmp_path_factory):
    return write_synthetic("qwen3_moe", tmp_path_factory.mktemp("mem") / "q", seed=3, num_experts=16, num_layers=5,
                           hidden_size=256, moe_intermediate_size=512, intermediate_size=256, vocab_size=256)


def test_peak_memory_is_the_local_share(big_experts):
    res = run_group(memory_program, 4, model_dir=str(big_experts), k=4, s=4, timeout_s=180)
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    for rank, (_, r) in sorted(res.items()):
        total, local, dense, peak = r["total_expert_bytes"], r["local_expert_bytes"], r["dense_bytes"], r["peak_growth"]
        assert total >= 90 * MiB and local == total // 4
        print(f"rank {rank}: peak growth {peak / MiB:.1f} MiB, local experts {local / MiB:.1f} MiB, "
              f"dense {dense / MiB:.1f} MiB, all experts {total / MiB:.1f} MiB")
        # transient: dense weights + the handle being filled (+ one staging expert) + allocator slack
        assert peak <= dense + 2 * r["largest_local_weight"] + 8 * MiB, (rank, peak / MiB)
        # owned at the peak: far below the 96 MiB an unsharded load needs
        assert peak + local < total / 2, (rank, peak / MiB)
