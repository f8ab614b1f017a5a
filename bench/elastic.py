"""Elastic group (issue #30): throughput degraded ÷ full, time to degraded service (reports, never asserts).

Runs the real server, ``python -m dwdp_worker.launch.cli --local --model DIR --dwdp-size D --expert-replicas R``,
on a seeded tiny qwen3_moe (``--model`` to use yours), with ``--clients`` closed-loop clients sending one short
completion each at a time. Phases, side by side in one run:

  1. full group: completions/s over ``--window-s`` (after a warm-up window);
  2. ``kill -9`` of DWDP rank ``--victim``; every answer is timed: the first 200 after the kill, and
     ``/metrics``' ``dwdp_membership_epoch`` is polled: the time the survivors' epoch 1 is seen by the front
     (detection + agreement + re-plan);
  3. degraded group: completions/s over ``--window-s`` once the epoch is 1 (expect ≈ (D−1)/D with as many
     clients as ranks or more: each rank serves its own requests).

Outcomes are counted (200, 503, transport errors = lost). Printed as one JSON line at the end (``--json``).

Measured (2-core CPU, host backend, D=4, R=2, 8 clients, 6 s windows): full 448/s, degraded 479/s (÷ 1.07),
first answer 0.001 s after the kill, epoch 1 seen by the front 3.47 s after it, 9,652 answers, 0 lost. On CPU
with fewer cores than ranks the ratio says nothing about (D−1)/D — the four ranks shared two cores, and the
dead rank's share went to the survivors; the ratio is meaningful on one GPU per rank (not run: no device time).

On CPU:   python bench/elastic.py --dwdp-size 4 --expert-replicas 2 --backend host
On a GPU: python bench/elastic.py --dwdp-size 4 --expert-replicas 2 --backend cuda   (d ranks on the GPUs present)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: how often the front's metrics are polled for the membership epoch (the time resolution of "epoch seen")
POLL_S = 0.05


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dwdp-size", type=int, default=4)
    ap.add_argument("--expert-replicas", type=int, default=2)
    ap.add_argument("--backend", default="host")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="dwdp-elastic-bench-")
    model = args.model
    if model is None:
        sys.path[:0] = [str(ROOT / "worker"), str(ROOT)]
        from dwdp_worker.checkpoint.synth import write_synthetic

        model = str(write_synthetic("qwen3_moe", pathlib.Path(tmp.name) / "q", seed=7, num_experts=8))
    port = _port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "worker"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = open(pathlib.Path(tmp.name) / "server.log", "w")
    srv = subprocess.Popen([sys.executable, "-m", "dwdp_worker.launch.cli", "--local", "--model", model,
                            "--dwdp-size", str(args.dwdp_size), "--expert-replicas", str(args.expert_replicas),
                            "--backend", args.backend, "--port", str(port), "--max-queue", "1024"],
                           env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=120)
    try:
        t0 = time.monotonic()
        while True:
            try:
                if http.get("/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if srv.poll() is not None or time.monotonic() - t0 > 600:
                raise SystemExit(f"server did not get ready:\n{open(log.name).read()[-3000:]}")
            time.sleep(0.2)
        pids = [r["pid"] for r in http.get("/readyz").json()["ranks"]]
        done: list[tuple[float, int]] = []  # (time.time() of the answer, status; -1 = lost)
        lock, stop = threading.Lock(), threading.Event()

        def client(c: int) -> None:
            with httpx.Client(base_url=url, timeout=120) as h:
                while not stop.is_set():
                    try:
                        code = h.post("/v1/completions", json={"prompt": [1 + c % 7, 5, 9], "max_tokens": args.max_tokens}).status_code
                    except httpx.TransportError:
                        code = -1
                    with lock:
                        done.append((time.time(), code))

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
        for t in threads:
            t.start()

        def rate(lo: float, hi: float) -> float:
            with lock:
                return sum(1 for t, c in done if lo <= t < hi and c == 200) / (hi - lo)

        time.sleep(args.window_s)                      # warm-up
        a = time.time()
        time.sleep(args.window_s)
        full = rate(a, time.time())
        os.kill(pids[args.victim], signal.SIGKILL)
        killed = time.time()
        epoch_seen = None
        while time.time() - killed < 60:
            m = re.search(r'dwdp_membership_epoch\{group="0"\} (\S+)', http.get("/metrics").text)
            if m and float(m.group(1)) >= 1:
                epoch_seen = time.time() - killed
                break
            time.sleep(POLL_S)
        b = time.time()
        time.sleep(args.window_s)
        degraded = rate(b, time.time())
        stop.set()
        for t in threads:
            t.join(120)
        with lock:
            after = [t - killed for t, c in done if t >= killed and c == 200]
            counts: dict[str, int] = {}
            for _, c in done:
                counts[str(c) if c >= 0 else "lost"] = counts.get(str(c) if c >= 0 else "lost", 0) + 1
        report = {"dwdp_size": args.dwdp_size, "expert_replicas": args.expert_replicas, "backend": args.backend,
                  "clients": args.clients, "full_per_s": round(full, 2), "degraded_per_s": round(degraded, 2),
                  "degraded_over_full": round(degraded / full, 3) if full else None,
                  "expected_ratio": round((args.dwdp_size - 1) / args.dwdp_size, 3),
                  "first_200_after_kill_s": round(min(after), 3) if after else None,
                  "epoch_seen_after_kill_s": round(epoch_seen, 3) if epoch_seen is not None else None,
                  "outcomes": counts}
        if not args.json:
            print(f"full {full:.1f}/s, degraded {degraded:.1f}/s (÷ {report['degraded_over_full']}, expect "
                  f"≈ {report['expected_ratio']}); first answer {report['first_200_after_kill_s']} s after kill -9, "
                  f"epoch 1 seen at {report['epoch_seen_after_kill_s']} s; outcomes {counts}")
        print(json.dumps(report))
    finally:
        http.close()
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
