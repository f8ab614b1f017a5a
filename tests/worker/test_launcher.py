"""The local launcher: G×D ranks behind one port, spread over groups, bounded queue, CLI errors, demo."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from .serving_helpers import Server, child_env, free_port, greedy_reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from dwdp_worker.checkpoint.synth import write_synthetic

    return write_synthetic("mixtral", tmp_path_factory.mktemp("ckpt") / "mx", seed=11, num_experts=6)


def test_two_groups_spread_requests_and_queue_answers_429(model_dir):
    # 6 experts over 2 ranks with K=4, S=2: overlapping ranges (explicit flags, not the defaults).
    srv = Server(["--local", "--model", str(model_dir), "--groups", "2", "--dwdp-size", "2",
                  "--experts-per-worker", "4", "--prefetch-stride", "2", "--prefetch-slots", "3",
                  "--backend", "host", "--max-queue", "3", "--max-num-tokens", "64"])
    try:
        ready = srv.wait_for("/readyz", timeout_s=150)
        assert [(r["group"], r["rank"]) for r in ready["ranks"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        prompt = [9, 8, 7, 6, 5]
        want, want_lp, _ = greedy_reference(model_dir, prompt, 2)

        # Spread: sequential single-forward requests go to the least-loaded rank, over both groups.
        answers = [srv.post({"prompt": prompt, "max_tokens": 2, "logprobs": 0}) for _ in range(6)]
        served_by = set()
        for r in answers:
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["token_ids"] == want
            assert c["logprobs"]["token_logprobs"] == pytest.approx(want_lp, abs=1e-4)
            served_by.update(r.json()["timings"]["ranks"])
        assert served_by == {0, 1, 2, 3}, served_by
        groups = {rk["group"] for rk in srv.get("/readyz").json()["ranks"] if rk["sequences_served"] > 0}
        assert groups == {0, 1}

        # Bounded queue: a burst larger than 4 busy ranks + 3 queue slots gets 429s with a message;
        # every request is answered, and the server keeps serving.
        burst = [{"prompt": [1 + i % 50] * 20, "max_tokens": 25} for i in range(24)]
        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(srv.post, burst))
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(429) >= 1 and codes.count(200) >= 4, codes
        for r in results:
            if r.status_code == 429:
                assert "queue is full" in r.json()["error"]["message"]
            else:
                assert len(r.json()["choices"][0]["token_ids"]) == 25
        assert srv.post({"prompt": prompt, "max_tokens": 2}).json()["choices"][0]["token_ids"] == want
        metrics = srv.get("/metrics").text
        assert 'dwdp_requests_total{code="429"}' in metrics
        assert srv.get("/healthz").json()["forwards"] >= 4 + 6 * 2
    finally:
        srv.close()
    assert srv.proc.returncode == 0, srv.log()


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dwdp_worker.launch.cli", *args], env=child_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args,needle", [
    (["--prefetch-stride", "9"], "stride must be <= experts per worker"),
    (["--experts-per-worker", "2", "--prefetch-stride", "2"], "coverage rule"),
    (["--dwdp-size", "1"], "at least 2 ranks"),
    (["--groups", "0"], "--groups=0"),
    (["--backend", "host", "--cuda-graphs", "2"], "CUDA graphs need the ranks on GPUs"),
    (["--cuda-graphs", "-1"], "--cuda-graphs=-1: must be an integer >= 0"),
    (["--max-queue", "0"], "--max-queue=0: must be an integer >= 1"),
    (["--max-rank-respawns", "-1"], "--max-rank-respawns=-1: must be >= 0"),
])
def test_bad_sharding_is_refused_before_any_rank_starts(model_dir, args, needle):
    p = _cli("--local", "--model", str(model_dir), "--port", str(free_port()), *args)
    assert p.returncode == 2, p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr


def test_an_unknown_rank_start_is_refused_before_any_rank_starts(model_dir):
    p = subprocess.run([sys.executable, "-m", "dwdp_worker.launch.cli", "--local", "--model", str(model_dir),
                        "--port", str(free_port())], env=child_env({"DWDP_RANK_START": "fork"}),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "DWDP_RANK_START='fork': expected one of forkserver, spawn" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("start", ["forkserver", "spawn"])
def test_ranks_forked_or_spawned_serve_the_same_answer(model_dir, start):
    """Both ways the front starts its ranks (``DWDP_RANK_START``) give a serving group with the unsharded answer."""
    srv = Server(["--local", "--model", str(model_dir), "--dwdp-size", "2", "--backend", "host"],
                 env=child_env({"DWDP_RANK_START": start}))
    try:
        srv.wait_for("/readyz", timeout_s=150)
        prompt = [5, 3, 9]
        want, _, _ = greedy_reference(model_dir, prompt, 2)
        r = srv.post({"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
    finally:
        srv.close()
    assert srv.proc.returncode == 0, srv.log()


def test_cli_errors(tmp_path, model_dir):
    p = _cli("--local", "--model", str(tmp_path / "nowhere"))
    assert p.returncode == 2 and "no config.json" in p.stderr and "Traceback" not in p.stderr
    assert _cli().returncode == 2
    assert _cli("--local").returncode == 2  # argparse: --model or --synthetic is required
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        p = _cli("--local", "--model", str(model_dir), "--port", str(busy.getsockname()[1]))
    assert p.returncode == 2 and "cannot listen" in p.stderr


def test_synth_subcommand_delegates(tmp_path):
    p = _cli("synth", "qwen3_moe", "--out", str(tmp_path / "s"), "--num-experts", "4")
    assert p.returncode == 0, p.stderr
    from dwdp_worker.rank.engine import num_experts_of

    assert num_experts_of(tmp_path / "s") == 4


def test_demo_runs_end_to_end():
    p = _cli("demo", timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "MATCH" in p.stdout and "exited with code 0" in p.stdout
    assert '"status": "ready"' in p.stdout


def test_listening_socket_gives_nagle_free_connections():
    """Accepted connections must have TCP_NODELAY (else keep-alive answers stall ~40 ms)."""
    import asyncio
    import socket

    from dwdp_worker.front.serve import bind

    async def main():
        seen = {}

        class P(asyncio.Protocol):
            def connection_made(self, transport):
                sk = transport.get_extra_info("socket")
                seen["nodelay"] = sk.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                transport.close()

        with bind("127.0.0.1", 0) as sock:
            server = await asyncio.get_running_loop().create_server(P, sock=sock)
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()
            server.close()
        return seen

    assert asyncio.run(main()) == {"nodelay": 1}
