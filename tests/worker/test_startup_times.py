"""``StartupTimes`` (the rank's ``startup`` load line) and ``compile_cache`` (``DWDP_COMPILE_CACHE_DIR``)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from .serving_helpers import ROOT  # noqa: F401 - puts this checkout on sys.path

from dwdp_runtime import compile_cache
from dwdp_worker.rank.startup import StartupTimes


def test_the_startup_line_round_trips_and_refuses_unknown_fields():
    st = StartupTimes(import_s=1.25, rendezvous_s=0.5, manager_s=0.125, model_s=2.0, read_s=3.5, map_s=0.25,
                      attach_s=0.0625, kv_s=0.0, graphs_s=0.0, warmup_s=4.0, read_bytes=7 << 30,
                      cache_files_before=3, cache_files_after=19)
    back = StartupTimes.parse(st.describe())  # the line keeps milliseconds
    for f in dataclasses.fields(StartupTimes):
        assert getattr(back, f.name) == pytest.approx(getattr(st, f.name), abs=1e-3), f.name
    assert back.total_s == pytest.approx(1.25 + 0.5 + 0.125 + 2.0 + 3.5 + 0.25 + 0.0625 + 4.0, abs=1e-2)
    assert back.read_gb_s == pytest.approx((7 << 30) / 3.5 / 1e9)
    assert isinstance(back.read_bytes, int) and back.read_bytes == 7 << 30
    assert {f.name for f in dataclasses.fields(StartupTimes)} == {p.split("=")[0] for p in st.describe().split()}
    with pytest.raises(ValueError, match="unknown field 'compile_s'"):
        StartupTimes.parse("import_s=1.0 compile_s=2.0")


def test_compile_cache_points_every_cache_below_the_path_and_keeps_explicit_ones(tmp_path):
    env = {"DWDP_COMPILE_CACHE_DIR": str(tmp_path / "cc"), "CUTE_DSL_CACHE_DIR": str(tmp_path / "mine")}
    cache = compile_cache.apply(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "cc" / "triton")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc" / "inductor")
    assert env["CUTE_DSL_CACHE_DIR"] == str(tmp_path / "mine")  # an explicit setting wins
    assert all(os.path.isdir(d) for d in cache.dirs.values())
    assert cache.entries() == 0
    (tmp_path / "cc" / "triton" / "abc").mkdir()
    (tmp_path / "cc" / "triton" / "abc" / "k.cubin").write_bytes(b"x")
    assert cache.entries() == 1
    unset = {}
    assert compile_cache.apply(unset).root is None and unset == {}  # unset: the libraries' defaults, untouched


def test_an_engine_build_reports_its_phases(tmp_path):
    """A real CPU group of 2 ranks (threads): every build phase measured, bytes read = dense + local experts."""
    import threading

    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.rendezvous import StoreRendezvous
    from dwdp_worker.checkpoint.synth import write_synthetic
    from dwdp_runtime.ports import free_port
    from dwdp_worker.rank.engine import Engine

    ckpt = write_synthetic("qwen3_moe", tmp_path / "m", seed=0, num_experts=4, num_layers=2, hidden_size=64,
                           vocab_size=128)
    cfg = DwdpConfig.even(dwdp_size=2, num_experts=4)
    port, got = free_port(), {}

    def rank(r):
        try:
            with StoreRendezvous(host="127.0.0.1", port=port, rank=r, world_size=2, job="t", token="t",
                                 timeout_s=60) as rdzv:
                engine = Engine.build(model_dir=ckpt, config=cfg, rank=r, rendezvous=rdzv, backend="host",
                                      progress=False)
                got[r] = (engine.startup, engine.load_report)
                engine.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            got[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in (0, 1):
        assert not isinstance(got[r], BaseException), got[r]
        st, rep = got[r]
        assert st.read_bytes == rep.dense_bytes + rep.local_expert_bytes > 0
        assert st.read_s > 0 and st.map_s > 0 and st.model_s > 0 and st.manager_s > 0


def test_the_background_prewarm_leaves_tritons_cache_key_computed_in_a_fresh_process():
    """The warm-up of a start that compiles nothing then finds Triton's key already hashed."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = ("import dwdp_runtime.compile_cache as c, sys\n"
            "from triton.runtime.cache import triton_key\n"
            "assert triton_key.cache_info().currsize == 0\n"
            "c.prewarm_in_background().join()\n"
            "assert triton_key.cache_info().currsize == 1, triton_key.cache_info()\n"
            "assert 'triton.experimental.gluon' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_a_cache_directory_that_cannot_be_made_is_a_warning_not_a_failed_start(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {"DWDP_COMPILE_CACHE_DIR": str(blocker / "cache"), "CUTE_DSL_CACHE_DIR": str(tmp_path / "mine")}
    with caplog.at_level("WARNING", logger="dwdp_runtime.compile_cache"):
        cache = compile_cache.apply(env)
    assert "TRITON_CACHE_DIR" not in env and "TORCHINDUCTOR_CACHE_DIR" not in env  # library defaults kept
    assert cache.dirs == {"CUTE_DSL_CACHE_DIR": str(tmp_path / "mine")}
    assert sum("cannot create the" in r.getMessage() for r in caplog.records) == 2
