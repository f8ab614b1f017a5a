"""The Engine contract the serving layer codes against, on a real 2-rank group (host backend)."""

from __future__ import annotations

import pytest

from tests.runtime.group import run_group
from tests.worker.programs import engine_api_program

from dwdp_runtime.config import DwdpConfig
from dwdp_worker.rank.engine import Engine, num_experts_of


def test_engine_contract(checkpoints):
    res = run_group(engine_api_program, 2, model_dir=str(checkpoints["qwen3_moe"]), harness_timeout_s=120)
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    for rank, (_, out) in res.items():
        assert len(out["errors"]) == 7, out["errors"]
        assert any("outside the vocabulary" in e for e in out["errors"])
        assert any("max_position_embeddings" in e for e in out["errors"])
        assert out["shape"] == (2, 256) and out["dtype"] == "torch.float32"
        assert out["compute_s"] > 0 and out["wait_s"] >= 0 and out["restarts"] == 0
        assert out["vocab"] == 256 and out["max_positions"] == 4096
        st = out["stats"]  # protocol.RankStats: the record the rank's heartbeats carry
        assert st.forwards == 1 and st.backend == "host" and st.remote_bytes_per_forward > 0
        assert st.prefetch_bytes >= st.remote_bytes_per_forward and st.last_forward_s > 0 and st.error is None
        assert out["after_close"] == "engine is closed"


def test_num_experts_of_every_arch(checkpoints):
    for name in ("qwen3_moe", "mixtral", "deepseek_v3"):
        assert num_experts_of(checkpoints[name]) == 8


def test_build_refuses_a_config_for_another_expert_count(checkpoints):
    cfg = DwdpConfig.even(dwdp_size=2, num_experts=16)
    with pytest.raises(ValueError, match=r"num_experts=16 but the model .* has 8 routed experts"):
        Engine.build(model_dir=checkpoints["mixtral"], config=cfg, rank=0, rendezvous=None, backend="host")


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    from dwdp_worker.checkpoint.safetensors_index import CheckpointError

    with pytest.raises(CheckpointError, match="no config.json"):
        num_experts_of(tmp_path)
