"""Elastic group (issue #30): throughput full, degraded and restored; time to degraded service and to rejoin
(reports, never asserts).

Runs the real server, ``python -m dwdp_worker.launch.cli --local --model DIR --dwdp-size D --expert-replicas R``,
on a seeded tiny qwen3_moe (``--model`` to use yours), with ``--clients`` closed-loop clients sending one short
completion each at a time. Phases, side by side in one run:

  1. full group: completions/s over ``--window-s`` (after a warm-up window);
  2. ``--signal kill`` (kill -9) or ``stop`` (SIGSTOP; with ``--victim 0``, the store's host) of DWDP rank
     ``--victim``; every answer is timed, and ``/metrics`` is polled: when the survivors' epoch 1 is seen by the
     front (detection + agreement + re-plan; after SIGSTOP of the store host also the store's move), and when the
     front's replacement of the lost rank has rejoined (``dwdp_rank_rejoins_total``: spawn, load, warm-up, join);
  3. degraded group: completions/s from epoch 1 until the rejoin (expect ≈ (D−1)/D with one device per rank and
     as many clients as ranks or more: each rank serves its own requests);
  4. restored group: completions/s over ``--window-s`` after the rejoin.

Outcomes are counted (200, 503, transport errors = lost). Printed as one JSON line at the end (``--json``).

Measured: see docs/RELIABILITY.md ("Elastic group") for the figures with dates and machines. With fewer cores (or
GPUs) than ranks the degraded ratio says nothing about (D−1)/D: the ranks share the device, and the dead rank's
share goes to the survivors.

On CPU:   python bench/elastic.py --dwdp-size 4 --expert-replicas 2 --backend host [--signal stop --victim 0]
On a GPU: python bench/elastic.py --dwdp-size 4 --expert-replicas 2 --backend cuda   (d ranks on the GPUs present)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dwdp_runtime.ports import free_port  # noqa: E402 - stdlib only, after the path set-up

#: how often the front's metrics are polled for the membership epoch (the time resolution of "epoch seen")
POLL_S = 0.05
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def _metric(text: str, name: str) -> float | None:
    m = re.search(name + r'\{group="0"\} (\S+)', text)
    return float(m.group(1)) if m else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dwdp-size", type=int, default=4)
    ap.add_argument("--expert-replicas", type=int, default=2)
    ap.add_argument("--backend", default="host")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--window-s", type=float, default=10.0)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--signal", choices=sorted(SIGNALS), default="kill")
    ap.add_argument("--rejoin-timeout-s", type=float, default=300.0)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory(prefix="dwdp-elastic-bench-")
    model = args.model
    if model is None:
        sys.path[:0] = [str(ROOT / "worker"), str(ROOT)]
        from dwdp_worker.checkpoint.synth import write_synthetic

        model = str(write_synthetic("qwen3_moe", pathlib.Path(tmp.name) / "q", seed=7, num_experts=8))
    port = free_port()
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
        done: list[tuple[float, int, float]] = []  # (time.time() of the answer, status (-1 = lost), latency)
        lock, stop = threading.Lock(), threading.Event()

        def client(c: int) -> None:
            with httpx.Client(base_url=url, timeout=120) as h:
                while not stop.is_set():
                    t0 = time.time()
                    try:
                        code = h.post("/v1/completions", json={"prompt": [1 + c % 7, 5, 9], "max_tokens": args.max_tokens}).status_code
                    except httpx.TransportError:
                        code = -1
                    with lock:
                        done.append((time.time(), code, time.time() - t0))

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
        for t in threads:
            t.start()

        def rate(lo: float, hi: float) -> float:
            with lock:
                return sum(1 for t, c, _ in done if lo <= t < hi and c == 200) / (hi - lo)

        time.sleep(args.window_s)                      # warm-up
        a = time.time()
        time.sleep(args.window_s)
        full = rate(a, time.time())
        os.kill(pids[args.victim], SIGNALS[args.signal])
        killed = time.time()
        epoch_seen = rejoined = None
        while time.time() - killed < args.rejoin_timeout_s:
            metrics = http.get("/metrics").text
            if epoch_seen is None and (_metric(metrics, "dwdp_membership_epoch") or 0) >= 1:
                epoch_seen = time.time() - killed
            if epoch_seen is not None and (_metric(metrics, "dwdp_rank_rejoins_total") or 0) >= 1:
                rejoined = time.time() - killed
                break
            time.sleep(POLL_S)
        degraded = rate(killed + epoch_seen, killed + rejoined) if epoch_seen and rejoined else None
        c = time.time()
        time.sleep(args.window_s)
        restored = rate(c, time.time())
        metrics = http.get("/metrics").text
        stop.set()
        for t in threads:
            t.join(120)
        with lock:
            after = [(t - killed, lat) for t, code, lat in done if t >= killed and code == 200]
            counts: dict[str, int] = {}
            for _, code, _ in done:
                counts[str(code) if code >= 0 else "lost"] = counts.get(str(code) if code >= 0 else "lost", 0) + 1
        report = {"dwdp_size": args.dwdp_size, "expert_replicas": args.expert_replicas, "backend": args.backend,
                  "signal": args.signal, "victim": args.victim, "clients": args.clients,
                  "full_per_s": round(full, 2), "degraded_per_s": round(degraded, 2) if degraded else None,
                  "restored_per_s": round(restored, 2),
                  "degraded_over_full": round(degraded / full, 3) if full and degraded else None,
                  "restored_over_full": round(restored / full, 3) if full else None,
                  "expected_ratio": round((args.dwdp_size - 1) / args.dwdp_size, 3),
                  "first_200_after_signal_s": round(min(t for t, _ in after), 3) if after else None,
                  "longest_request_across_loss_s": round(max(lat for _, lat in after), 3) if after else None,
                  "epoch_seen_after_signal_s": round(epoch_seen, 3) if epoch_seen is not None else None,
                  "rejoined_after_signal_s": round(rejoined, 3) if rejoined is not None else None,
                  "store_failovers": _metric(metrics, "dwdp_store_failovers_total"),
                  "outcomes": counts}
        if not args.json:
            print(f"full {full:.1f}/s, degraded {report['degraded_per_s']}/s (÷ {report['degraded_over_full']}, "
                  f"expect ≈ {report['expected_ratio']} with one device per rank), restored {restored:.1f}/s "
                  f"(÷ {report['restored_over_full']}); {args.signal} of rank {args.victim}: first answer "
                  f"{report['first_200_after_signal_s']} s after, epoch 1 seen at {report['epoch_seen_after_signal_s']} "
                  f"s, rejoined at {report['rejoined_after_signal_s']} s, longest request "
                  f"{report['longest_request_across_loss_s']} s; outcomes {counts}")
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
