"""KV handoff round trip on CPU (docs/KV_TRANSFER.md): a real DWDP group prefills, a separate process pulls
over NIXL with the reference client and decodes with plain transformers."""

from __future__ import annotations


import pytest

from dwdp_worker.kv.nixl_api import nixl_installed

from tests.processes import process

from ..runtime.group import job_ports, run_group
from .kv_programs import decode_program, prefill_program

# the kv extra installs nixl-cu13, whose module is nixl_cu13 (only the `nixl` meta package provides `nixl`)
if not nixl_installed():
    pytest.skip("KV transfer tests need NIXL (the kv extra)", allow_module_level=True)

ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
#: prompts of different lengths, packed together in one prefill
PROMPTS = [[5, 17, 42], [9, 1, 200, 33, 7, 64, 120], [3, 250, 11, 90, 18, 6, 77, 140, 2, 8, 51, 99]]
NEW_TOKENS = 16


@pytest.mark.parametrize("world", [2, 3])
def test_round_trip_every_arch(world, checkpoints, tmp_path):
    runs = [(f"kv{world}{a[:3]}", str(checkpoints[a])) for a in ARCHS]
    exchange = tmp_path / "x"
    exchange.mkdir()
    result = tmp_path / "decode.json"
    decoder = process(decode_program, kwargs=dict(runs=runs, world=world, prompts=PROMPTS, exchange=str(exchange),
                                                  new_tokens=NEW_TOKENS, result=str(result)), daemon=False)
    decoder.start()
    try:
        res = run_group(prefill_program, world, runs=runs, store_ports=job_ports(job for job, _ in runs),
                        prompts=PROMPTS, exchange=str(exchange), new_tokens=NEW_TOKENS, harness_timeout_s=240)
    finally:
        decoder.join(timeout=60)
        if decoder.is_alive():
            decoder.kill()
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    assert decoder.exitcode == 0
    import json

    report = json.loads(result.read_text())
    for job, _ in runs:
        expected = report[job]["expected"]
        assert all(len(t) == NEW_TOKENS for t in expected)
        for rank in range(world):
            rows = report[job]["ranks"][str(rank)]
            served = res[rank][1][job]
            for i, row in enumerate(rows):
                assert row["layers"] == row["ref_layers"] == 3
                assert row["kv_equal"], (job, rank, i)
                assert row["shapes"][0][0][2] == len(PROMPTS[i])            # [1, heads, seq, dim]
                assert row["tokens"] == expected[i], (job, rank, i)          # pulled KV → plain transformers
                assert served["decoded"][i] == expected[i], (job, rank, i)   # the engine's own cache path
            assert served["same_logits"]            # keeping the KV / decoding on never changes the first step
            full = served["full"]
            assert full["errors"] and all("KV budget full" in e for e in full["errors"])
            assert full["kept"] > 0 and full["peak"] <= full["budget"] and full["full_total"] == len(full["errors"])
            st = served["stats"]
            assert st.kv.pulls_total == len(PROMPTS) and st.kv.held_sequences == 0
            assert st.kv.held_bytes == 0 and st.kv.expirations_total == 0
