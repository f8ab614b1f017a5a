"""A rank never materialises all experts: peak RSS growth of ``Engine.build`` is bounded by its local share.

Checkpoints: Qwen3-MoE (per-expert keys) and gpt-oss (biased experts, fused keys), 16 experts x 4 MoE layers,
experts ~96 MiB in all (dense a few MiB). With d=4 each rank owns 4 experts per layer (24 MiB). The peak is the kernel's high-water mark (``VmHWM``, reset through
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

from dwdp_worker.checkpoint.synth import write_synthetic

MiB = 2**20


#: (model type, synth arguments): ~96 MiB of experts either way (16 experts x 4 MoE layers, float32)
CHECKPOINTS = {
    # per-expert checkpoint keys (MergeModulelist), a dense layer among them
    "qwen3_moe": dict(num_experts=16, num_layers=5, hidden_size=256, moe_intermediate_size=512,
                      intermediate_size=256, vocab_size=256),
    # biased experts (gate_up_proj_bias / down_proj_bias sharded like the weights), fused [E, H, 2I] keys
    "gpt_oss": dict(config_overrides=dict(hidden_size=256, intermediate_size=512, num_local_experts=16,
                                          num_hidden_layers=4, head_dim=64)),
}


@pytest.mark.parametrize("model_type", sorted(CHECKPOINTS))
def test_peak_memory_is_the_local_share(model_type, tmp_path):
    path = write_synthetic(model_type, tmp_path / model_type, seed=3, **CHECKPOINTS[model_type])
    res = run_group(memory_program, 4, fresh_interpreters=True, model_dir=str(path), k=4, s=4, harness_timeout_s=180)
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
