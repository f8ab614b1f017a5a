"""Render a ``PlanResult`` for people (a table; ``rich`` when installed, plain text otherwise) or
machines (``PlanResult.to_json()``). Formatting only: no arithmetic beyond unit display."""

from __future__ import annotations

from .plan import PlanResult


def rows(r: PlanResult) -> list[tuple[str, str]]:
    rec = r.recommended
    mem = r.memory_gib
    out = [
        ("model / dtype / hardware", f"{r.model} / {r.dtype} (dense {r.dense_dtype}) / {r.hardware}"),
        ("workload", f"isl={r.isl} batch={r.batch} cv={r.cv:g}"),
        ("DWDP config", f"d={r.dwdp_size} k={r.experts_per_worker} s={r.prefetch_stride} "
                        f"slots={r.prefetch_slots} contention_opt={r.contention_opt}"),
        ("— per MoE layer —", ""),
        ("T_compute (roofline)", f"{r.t_compute_us:,.1f} µs"),
        ("T_compute under copies", f"{r.t_compute_dwdp_us:,.1f} µs"),
        ("T_prefetch", f"{r.t_prefetch_us:,.1f} µs ({r.remote_experts_per_layer} experts, "
                       f"{r.remote_gib_per_layer:.2f} GiB; contention ×{r.contention_factor:.2f})"),
        ("T_DWDP = max(...)", f"{r.t_dwdp_us:,.1f} µs"),
        ("T_DEP", f"{r.t_dep_us:,.1f} µs = compute {r.t_compute_dep_us:,.1f} + all2all "
                  f"{r.t_all2all_us:,.1f} + sync {r.t_sync_us:,.1f}"),
        ("T_compute / T_prefetch", f"{r.compute_over_prefetch:.3f}"),
        ("speedup T_DEP / T_DWDP", f"{r.speedup:.3f}"),
        ("crossover isl", f"{r.crossover_isl}" if r.crossover_isl else r.crossover_note),
        ("— whole forward —", ""),
        ("DWDP (steady) / DEP", f"{r.forward['dwdp_us'] / 1e3:,.2f} ms / {r.forward['dep_us'] / 1e3:,.2f} ms "
                                f"(speedup {r.forward['speedup']:.3f})"),
        ("— memory per GPU (GiB) —", ""),
        ("dense weights", f"{mem['dense_weights']:.2f}"),
        ("local experts", f"{mem['local_experts']:.2f}"),
        *([("local expert scales", f"{mem['local_expert_scales']:.2f}")] if mem.get("local_expert_scales") else []),
        *([(f"replica experts (r={r.expert_replicas})", f"{mem['replica_experts']:.2f}")]
          if mem.get("replica_experts") else []),
        ("pool slots", f"{mem['pool_slots']:.2f}"),
        *([("W4A8 re-encoded layer (FP4 experts)", f"{mem['w4a8_scratch']:.2f}")] if mem.get("w4a8_scratch") else []),
        ("activations + CUDA graphs + reserved", f"{mem['activations']:.2f} + {mem['graph_pool']:.2f} + {mem['reserved']:.2f}"),
        ("left for KV cache", f"{mem['kv_cache_available']:.2f} of {mem['capacity']:.2f} "
                              f"(this workload needs {mem['kv_needed']:.2f})"),
        ("fits", "yes" if r.fits else "NO"),
        ("recommended", (f"d={rec['dwdp_size']} k={rec['experts_per_worker']} s={rec['prefetch_stride']} "
                         f"slots={rec['prefetch_slots']} → T_DWDP {rec['t_dwdp_us']:,.1f} µs/layer, "
                         f"KV left {rec['kv_cache_available_gib']:.1f} GiB") if rec else
         "nothing fits this GPU with this workload"),
    ]
    out += [("note", n) for n in r.notes]
    return out


def render_text(r: PlanResult) -> str:
    rs = rows(r)
    w = max(len(k) for k, _ in rs)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rs)


def print_table(r: PlanResult) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(render_text(r))
        return
    t = Table(title="dwdp plan: DWDP vs DEP (roofline)", show_header=False)
    t.add_column(style="bold")
    t.add_column()
    for k, v in rows(r):
        t.add_row(k, v)
    Console().print(t)
