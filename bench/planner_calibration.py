"""Compare the planner's prediction with a measured `bench/prefill.py` run for the same shapes.

Reads the model name line and the result table of a prefill log (e.g.
docs/gpu-runs/2026-11-29-h200-prefill.log), rebuilds the synthetic model's config.json with the
same sizes, asks `dwdp_runtime.planner.plan` for the same ISL and dwdp_size, and prints predicted
vs measured forward times with the relative error (negative: the planner is optimistic).
Reports, never asserts.

    python bench/planner_calibration.py docs/gpu-runs/2026-11-29-h200-prefill.log --hardware h200-hgx
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "worker")]

NAME = re.compile(r"(?P<arch>\w+)-L(?P<L>\d+)-H(?P<H>\d+)-E(?P<E>\d+)-I(?P<I>\d+)-k(?P<k>\d+)-V(?P<V>\d+)-(?P<dtype>\w+)-P(?P<P>\d+)")
DWDP = re.compile(r"dwdp_size=(\d+)")


def parse(log: str) -> dict:
    m = NAME.search(log)
    if not m:
        raise SystemExit("no model name line (arch-L..-H..-E..) in the log")
    d = DWDP.search(log)
    rows = [line.split() for line in log.splitlines() if re.match(r"\s*\d+\s+\d+\s+\d+", line)]
    if not rows:
        raise SystemExit("no result row in the log")
    isl, _tokens, _u_tps, _s_tps, _ratio, u_ms, s_ms = rows[-1][:7]
    return {**{k: int(v) if v.isdigit() else v for k, v in m.groupdict().items()},
            "dwdp_size": int(d.group(1)) if d else 4, "isl": int(isl),
            "unsharded_ms": float(u_ms), "sharded_ms": float(s_ms)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=pathlib.Path)
    ap.add_argument("--hardware", default="h200-hgx")
    args = ap.parse_args(argv)
    m = parse(args.log.read_text())
    from dwdp_runtime.planner import plan
    from dwdp_worker.checkpoint.synth import _config

    cfg = _config(m["arch"], num_experts=m["E"], num_layers=m["L"], hidden_size=m["H"], vocab_size=m["V"],
                  intermediate_size=4 * m["H"], moe_intermediate_size=m["I"], num_heads=max(2, m["H"] // 128),
                  max_positions=max(m["isl"], 4096), top_k=m["k"])
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "config.json"
        cfg.to_json_file(path)
        dtype = {"bfloat16": "bf16", "float16": "bf16", "float32": "bf16"}[m["dtype"]]
        r = plan(model=str(path), dtype=dtype, hardware=args.hardware, isl=m["isl"], dwdp_size=m["dwdp_size"],
                 with_crossover=False, with_recommendation=False)
    pred_ms = r.forward["dwdp_us"] / 1e3
    print(f"model {m['arch']} L{m['L']} H{m['H']} E{m['E']} I{m['I']} top-{m['k']}, isl {m['isl']}, "
          f"dwdp_size {m['dwdp_size']}, hardware preset {args.hardware}")
    print("| quantity | planner | measured | error |\n|---|---|---|---|")
    compute_ms = r.t_compute_us * m["L"] / 1e3  # every layer of the synthetic model is a MoE layer
    for label, pred, meas in (("DWDP forward (sharded) ms", pred_ms, m["sharded_ms"]),
                              ("compute-only forward (unsharded) ms: T_compute × layers", compute_ms, m["unsharded_ms"])):
        print(f"| {label} | {pred:.2f} | {meas:.2f} | {100 * (pred - meas) / meas:+.0f} % |")
    print(f"| per-layer T_compute / T_prefetch µs (planner) | {r.t_compute_us:.0f} / {r.t_prefetch_us:.0f} | – | – |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
