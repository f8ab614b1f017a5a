"""``dwdp plan --sweep``: the shape of the DWDP paper's Figure 3 as a PNG.

Left: T_compute / T_prefetch against input length; right: T_DEP / T_DWDP; one curve per batch
size, a dashed y = 1 line. matplotlib is imported lazily (only here), with the Agg backend, so
the planner itself never needs it.
"""

from __future__ import annotations

import math

from .evaluator import Evaluator

DEFAULT_BATCHES = (1, 2, 4, 8)


def sweep_points(ev: Evaluator, *, d: int, k: int, s: int, batches, cv: float, isl_min: int = 1024,
                 isl_max: int = 65536, per_octave: int = 4) -> dict[int, list[tuple[int, float, float]]]:
    """``{batch: [(isl, T_compute/T_prefetch, T_DEP/T_DWDP), ...]}`` on a geometric grid."""
    pf = ev.prefetch(dwdp_size=d, k=k, s=s)
    n = int(round(math.log2(isl_max / isl_min) * per_octave))
    grid = sorted({int(round(isl_min * 2 ** (i / per_octave))) for i in range(n + 1)})
    out = {}
    for b in batches:
        pts = []
        for isl in grid:
            lt = ev.layer_times(isl=isl, batch=b, cv=cv, d=d, pf=pf)
            pts.append((isl, lt.t_compute / lt.t_prefetch, lt.speedup))
        out[b] = pts
    return out


def write_png(path: str, points: dict[int, list[tuple[int, float, float]]], *, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for b, pts in points.items():
        xs = [p[0] for p in pts]
        a1.plot(xs, [p[1] for p in pts], marker=".", label=f"batch {b}")
        a2.plot(xs, [p[2] for p in pts], marker=".", label=f"batch {b}")
    for ax, yl in ((a1, "T_compute / T_prefetch"), (a2, "T_DEP / T_DWDP")):
        ax.axhline(1.0, ls="--", c="k", lw=1)
        ax.set_xscale("log", base=2)
        if ax is a1:
            ax.set_yscale("log")
        ax.set_xlabel("input length (tokens)")
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
