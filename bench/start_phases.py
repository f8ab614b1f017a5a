"""Where a rank's start spends host time outside the read: the config, CUDA's initialisation, the first forward
(reports; issue #34, cold start).

``bench/cold_start.py`` gives each phase's seconds (``model_s``, ``warmup_s``, …); this bench says what is inside
two of them, each in a fresh interpreter as a rank has it:

  * ``config``: ``load_config`` (transformers' ``AutoConfig``) timed before and after CUDA is initialised, and
    ``torch.cuda.init()`` timed alone — whether the config pays the driver's start; again with
    ``HF_HUB_OFFLINE=1``; the last one's ``cProfile`` listing;
  * ``first-forward``: the unsharded model (``launch.oracle.Reference`` with the engine's experts kernels) runs
    the warm-up's 4 tokens under ``cProfile``, twice in fresh processes sharing one compile cache (the second is a
    second start's warm-up: nothing compiles); the functions with the most cumulative and own time are printed.

Run on a GPU:   python bench/start_phases.py --model DIR [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

#: the warm-up's tokens (``rank.protocol.RankSpec.warmup_tokens``)
WARMUP_TOKENS = [0, 1, 2, 3]
#: rows of each cProfile listing
ROWS = 30


def _config_child(model: str, cuda_first: bool) -> dict:
    import time

    t0 = time.monotonic()
    import torch
    t_torch = time.monotonic()
    out = {"import_torch_s": t_torch - t0}
    if cuda_first:
        torch.cuda.init()
        out["cuda_init_s"] = time.monotonic() - t_torch
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t1 = time.monotonic()
    prof.enable()
    from dwdp_worker.checkpoint.loader import load_config
    load_config(model)
    prof.disable()
    out["load_config_s"] = time.monotonic() - t1
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(ROWS)
    out["profile"] = text.getvalue()
    if not cuda_first:
        t2 = time.monotonic()
        torch.cuda.init()
        out["cuda_init_s"] = time.monotonic() - t2
    return out


def _forward_child(model: str) -> dict:
    import cProfile
    import io
    import pstats
    import time

    import torch

    from dwdp_worker.launch.oracle import Reference

    ref = Reference(model, dtype="bfloat16", device="cuda:0", experts="auto")
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.monotonic()
    prof.enable()
    ref.logits([WARMUP_TOKENS])
    torch.cuda.synchronize()
    prof.disable()
    first = time.monotonic() - t0
    t1 = time.monotonic()
    ref.logits([WARMUP_TOKENS])
    torch.cuda.synchronize()
    second = time.monotonic() - t1
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(ROWS)
    stats.sort_stats("tottime").print_stats(ROWS)
    return {"first_forward_s": first, "second_forward_s": second, "profile": text.getvalue()}


def _child(kind: str, model: str, cuda_first: bool, env: dict | None = None) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", kind, "--model", model,
                           *(["--cuda-first"] if cuda_first else [])],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise SystemExit(f"{kind} child failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--child", choices=["config", "forward"], default="", help=argparse.SUPPRESS)
    ap.add_argument("--cuda-first", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        out = _config_child(args.model, args.cuda_first) if args.child == "config" else _forward_child(args.model)
        print(json.dumps(out))
        return
    result = {"config_then_cuda": _child("config", args.model, False),
              "cuda_then_config": _child("config", args.model, True),
              "config_hub_offline": _child("config", args.model, False, {"HF_HUB_OFFLINE": "1"})}
    for key in ("config_then_cuda", "cuda_then_config", "config_hub_offline"):
        profile = result[key].pop("profile")
        print(f"{key}:", result[key])
    print(profile)
    with tempfile.TemporaryDirectory(prefix="dwdp-start-phases-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache
        for start in ("first", "second"):
            r = _child("forward", args.model, False)
            print(f"=== {start} start: first forward {r['first_forward_s']:.3f} s, the next {r['second_forward_s']:.3f} s")
            print(r.pop("profile"))
            result[f"{start}_start"] = r
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
