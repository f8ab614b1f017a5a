"""KV settings from flags and env; KV metrics and the /healthz budget summary from rank stats."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from dwdp_worker.kv.metrics import KvCollector, budget_summary, rank_kv
from dwdp_worker.kv.options import add_kv_arguments, settings_from_args, settings_from_env
from dwdp_worker.kv.region import KvRegion
from dwdp_worker.kv.store import KvStore


def parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_kv_arguments(p)
    return p


def test_flags_take_units_and_default_off():
    assert not settings_from_args(parser().parse_args([])).enabled
    s = settings_from_args(parser().parse_args(["--kv-budget-bytes", "2GiB", "--kv-block-bytes", "64KiB",
                                                "--kv-ttl-s", "5"]))
    assert (s.budget_bytes, s.block_bytes, s.ttl_s, s.enabled) == (2 << 30, 64 << 10, 5.0, True)
    with pytest.raises(argparse.ArgumentError, match="not a size"):
        parser().parse_args(["--kv-budget-bytes", "lots"])
    with pytest.raises(ValueError, match="multiple of 64"):
        settings_from_args(parser().parse_args(["--kv-block-bytes", "100"]))
    with pytest.raises(ValueError, match="smaller than one block"):
        settings_from_args(parser().parse_args(["--kv-budget-bytes", "1KiB"]))


def test_env_names_the_bad_variable():
    names = dict(budget="DWDP_KV_BUDGET_BYTES", block="DWDP_KV_BLOCK_BYTES", ttl="DWDP_KV_TTL_S")
    assert settings_from_env({"DWDP_KV_BUDGET_BYTES": "1MiB"}, **names).budget_bytes == 1 << 20
    assert not settings_from_env({}, **names).enabled
    with pytest.raises(ValueError, match="DWDP_KV_TTL_S='soon'"):
        settings_from_env({"DWDP_KV_TTL_S": "soon"}, **names)


def test_metrics_and_budget_summary_are_what_the_ranks_reported():
    import torch

    store = KvStore(KvRegion(8 * 1024, block_bytes=1024))
    store.put("a", [(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))], 4)
    store.put("b", [(torch.zeros(1, 1, 4, 8), torch.zeros(1, 1, 4, 8))], 4)
    store.claim("b", "dec", "n")
    store.release("b", claimer="dec", nonce="n", pulled=True)
    stats = {f"kv_{k}": v for k, v in store.stats().as_dict().items()} | {"forwards": 3}
    ranks = [{"global_id": 0, "kv": rank_kv(stats)}, {"global_id": 1, "kv": rank_kv({"forwards": 1})}]
    assert ranks[1]["kv"] is None
    summary = budget_summary(ranks)
    assert summary == {"budget_bytes": 8192, "held_bytes": 1024, "use": 0.125, "held_sequences": 1,
                       "pulls": 1, "expirations": 0}
    assert budget_summary([{"global_id": 0, "kv": None}]) is None
    reg = CollectorRegistry()
    reg.register(KvCollector(lambda: {"ranks": ranks}))
    text = generate_latest(reg).decode()
    assert 'dwdp_kv_held_bytes{rank="0"} 1024.0' in text
    assert 'dwdp_kv_pulls_total{rank="0"} 1.0' in text
    assert 'dwdp_kv_budget_bytes{rank="0"} 8192.0' in text
    assert 'rank="1"' not in text
