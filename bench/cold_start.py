"""Cold start: time from process start to ``/readyz`` = 200, by phase, first start vs second (reports, never asserts).

Each start runs the real server, ``python -m dwdp_worker.launch.cli --local --model DIR`` (one group of
``--dwdp-size`` ranks), with ``DWDP_COMPILE_CACHE_DIR`` = ``--cache-dir`` (``dwdp_runtime.compile_cache``; default:
a fresh temporary directory, so start 1 compiles from nothing and start 2 finds start 1's kernels). While it
loads, every line the server logs is printed here with the seconds since launch (progress on stdout); the
probe polls ``/readyz`` every ``POLL_S``. When it answers 200 the server is stopped (SIGTERM, drained) and the
next start begins. Rank 0's ``startup`` line (``rank.startup.StartupTimes``) splits its time:

  import (torch + runtime) · rendezvous · manager (backend, CUDA context) · model (config, transformers'
  modeling import, meta modules) · read (checkpoint → memory, GB/s and
  × the page-cache read rate of the same files) · map (peer handles + composites: the CUDA registration) ·
  attach · kv (NIXL registration) · graphs (bookkeeping; capture is at a shape's 2nd forward) · warm-up (the
  first forward: Triton compile or cache load) · other (spawn, interpreter start, front, probe granularity)

and the compile caches' file counts before/after (a start that compiled nothing adds none). Issue #34's goals:
the second start spends < 5 % of its time compiling (warm-up share), weight read ≥ 0.8× the page-cache rate.

On a GPU:  python bench/cold_start.py --dwdp-size 2 --backend cuda [--model DIR] [--cuda-graphs 2]
On CPU:    python bench/cold_start.py --dwdp-size 2 --backend host     (no kernels compile there)
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
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from dwdp_runtime.contract import TuningEnv  # noqa: E402 - stdlib only, after the path set-up
from dwdp_runtime.ports import free_port  # noqa: E402
from dwdp_worker.rank.startup import STEP, StartupTimes  # noqa: E402

POLL_S = 0.05
#: the front's log line of a rank's load report: "rank 0 (group 0, DWDP rank 0, pid N) load: startup: k=v …"
LOAD_LINE = re.compile(r"rank (\d+) \(group \d+, DWDP rank (\d+).*? load: (\w+): (.*)$")
#: how much of the page-cache rate the checkpoint read must reach (issue #34)
READ_GOAL = 0.8
COMPILE_GOAL = 0.05


def ensure_model(args) -> pathlib.Path:
    if args.model:
        return pathlib.Path(args.model)
    from dwdp_worker.checkpoint.synth import write_synthetic

    out = pathlib.Path(args.work_dir) / f"cold-{args.arch}-L{args.num_layers}-H{args.hidden_size}-E{args.num_experts}"
    if not (out / "config.json").is_file():
        print(f"writing synthetic checkpoint {out} ...", flush=True)
        write_synthetic(args.arch, out, seed=0, num_experts=args.num_experts, num_layers=args.num_layers,
                        hidden_size=args.hidden_size, moe_intermediate_size=args.hidden_size // 2,
                        intermediate_size=2 * args.hidden_size, dtype="bfloat16", tokenizer=True,
                        vocab_size=args.vocab_size, top_k=2)
    return out


def page_cache_rate(model_dir: pathlib.Path) -> tuple[float, int]:
    """GB/s of reading the checkpoint's files once they are in the page cache (read twice, the second timed)."""
    files = sorted(model_dir.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    buf = bytearray(64 << 20)
    best = 0.0
    for attempt in range(2):
        t0 = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass
        dt = time.perf_counter() - t0
        if attempt == 1:
            best = total / dt / 1e9 if dt > 0 else 0.0
    return best, total


def one_start(args, model_dir: pathlib.Path, cache_dir: str, index: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "dwdp_worker.launch.cli", "--local", "--model", str(model_dir), "--groups", "1",
           "--dwdp-size", str(args.dwdp_size), "--backend", args.backend, "--port", str(port), "--log-level", "info",
           *(["--cuda-graphs", str(args.cuda_graphs)] if args.cuda_graphs else []),
           *(["--batch-invariant"] if args.batch_invariant else [])]
    env = dict(os.environ)
    env[TuningEnv.COMPILE_CACHE_DIR.value] = cache_dir
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "worker"), str(ROOT / "operator"),
                                         env.get("PYTHONPATH", "")])
    for var in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUTE_DSL_CACHE_DIR"):
        env.pop(var, None)  # the bench measures DWDP_COMPILE_CACHE_DIR's effect alone
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(ROOT))
    reports: dict[int, dict[str, str]] = {}

    def pump():
        for line in proc.stdout:
            line = line.rstrip()
            print(f"  [start {index} +{time.monotonic() - t0:7.2f} s] {line}", flush=True)
            m = LOAD_LINE.search(line)
            if m:
                reports.setdefault(int(m.group(2)), {})[m.group(3)] = m.group(4)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    ready_s = None
    try:
        while time.monotonic() - t0 < args.timeout:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                    if r.status == 200:
                        ready_s = time.monotonic() - t0
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
    if ready_s is None:
        raise RuntimeError(f"start {index}: no /readyz = 200 within {args.timeout:g} s (exit code {proc.returncode})")
    time.sleep(0.2)  # the last lines of the log
    rank0 = reports.get(0, {})
    if STEP not in rank0:
        raise RuntimeError(f"start {index}: rank 0 logged no '{STEP}' line (got {sorted(rank0)})")
    return {"ready_s": ready_s, "startup": StartupTimes.parse(rank0[STEP])}


def row(index: int, r: dict, cache_rate: float) -> dict:
    st: StartupTimes = r["startup"]
    phases = {"import": st.import_s, "rendezvous": st.rendezvous_s, "manager": st.manager_s, "model": st.model_s,
              "read": st.read_s,
              "map": st.map_s, "attach": st.attach_s, "kv": st.kv_s, "graphs": st.graphs_s, "warmup": st.warmup_s}
    other = r["ready_s"] - sum(phases.values())
    return dict(start=index, ready_s=round(r["ready_s"], 3), **{f"{k}_s": round(v, 3) for k, v in phases.items()},
                other_s=round(other, 3), read_gb_s=round(st.read_gb_s, 3),
                read_vs_page_cache=round(st.read_gb_s / cache_rate, 3) if cache_rate else None,
                read_mib=round(st.read_bytes / 2**20, 1), compile_share=round(st.warmup_s / r["ready_s"], 4),
                cache_files_before=st.cache_files_before, cache_files_new=st.cache_files_after - st.cache_files_before)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint directory (default: a synthetic one under --work-dir)")
    p.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "deepseek_v3"))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "dwdp-bench"))
    p.add_argument("--dwdp-size", type=int, default=2)
    p.add_argument("--backend", default="auto", choices=("auto", "cuda", "host"))
    p.add_argument("--cuda-graphs", type=int, default=0)
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--starts", type=int, default=2)
    p.add_argument("--cache-dir", default=None, help="DWDP_COMPILE_CACHE_DIR of every start (default: a fresh "
                                                     "temporary directory: start 1 is cold)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    model_dir = ensure_model(args)
    cache_rate, size = page_cache_rate(model_dir)
    print(f"checkpoint {model_dir}: {size / 2**20:.1f} MiB, page-cache read {cache_rate:.2f} GB/s", flush=True)
    with tempfile.TemporaryDirectory(prefix="dwdp-compile-cache-") as tmp:
        cache_dir = args.cache_dir or tmp
        rows = []
        for i in range(1, args.starts + 1):
            print(f"start {i} (compile cache {cache_dir}):", flush=True)
            rows.append(row(i, one_start(args, model_dir, cache_dir, i), cache_rate))
    keys = ("ready_s", "import_s", "rendezvous_s", "manager_s", "model_s", "read_s", "map_s", "attach_s", "kv_s", "graphs_s",
            "warmup_s", "other_s")
    print()
    print("start " + " ".join(f"{k:>12}" for k in keys) + "   read GB/s (× page cache)  compile share  new cache files")
    for r in rows:
        print(f"{r['start']:>5} " + " ".join(f"{r[k]:>12.3f}" for k in keys)
              + f"   {r['read_gb_s']:6.2f} (×{r['read_vs_page_cache'] or 0:.2f})"
              + f"          {r['compile_share']:6.1%}  {r['cache_files_new']:>6}")
    last = rows[-1]
    print(f"start {last['start']}: compile share {last['compile_share']:.1%} (goal < {COMPILE_GOAL:.0%}), new cache files "
          f"{last['cache_files_new']}; read ×{last['read_vs_page_cache'] or 0:.2f} of the page-cache rate "
          f"(goal ≥ {READ_GOAL})", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(page_cache_gb_s=cache_rate, checkpoint_bytes=size,
                                                           rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
