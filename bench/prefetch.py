"""DWDP prefetch benchmark on CUDA: ratios measured side by side in one run, plus a PNG timeline.

    python bench/prefetch.py --out out/bench [--world 2] [--experts 64 --hidden 2048 --inter 768 --layers 8]

Starts ``--world`` real processes (one GPU each when enough are visible, else all on GPU 0) that form
one DWDP group (posix_fd handles, a TCPStore). Every rank pulls at the same time (barriers before
each timed section). For each transfer variant (copy_engine / batched × contention_opt off / on,
and sm_gather where available) it measures, per rank:

  * prefetch GB/s: forwards of bind/finish only (the manager's copy stream, events, cached plan)
    ÷ plain ``dst.copy_(peer_view)`` GB/s of the SAME (dst, src, n) list on a side stream;
  * per-layer time with compute ÷ max(compute alone, prefetch alone), for a grouped-GEMM MoE layer
    stack whose token count is calibrated so compute ≈ prefetch per layer; also with the compute
    on a higher-priority stream;
  * bind cost: host µs per ``wait_and_bind`` vs a naive bind that merges local + remote experts
    into one contiguous buffer (host µs, device µs, device bytes copied for local experts).
Rank 0 prints a markdown table and writes ``prefetch.json`` and ``timeline.png`` (compute vs copy
per layer, one forward of the default variant) under ``--out``.

On ONE GPU the "peers" are processes on the same GPU: copies are HBM→HBM and run on SMs (the
driver does not use a copy engine for same-device copies), so overlap numbers there are a
pessimistic proxy; the goals (≥ 0.95, ≤ 1.10) are stated for two GPUs over NVLink (x2).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from dwdp_runtime.ports import free_port  # noqa: E402 - stdlib only, after the path set-up

VARIANTS = [("copy_engine", False), ("copy_engine", True), ("batched", False), ("batched", True),
            ("sm_gather", False), ("sm_gather", True)]


class _Prefixed:
    """A rendezvous view with its own key namespace, so several managers can use one store."""

    def __init__(self, base, prefix: str):
        self._base, self._prefix = base, prefix
        self.rank, self.world_size = base.rank, base.world_size

    def allgather(self, key, value):
        return self._base.allgather(self._prefix + key, value)

    def barrier(self, key):
        return self._base.barrier(self._prefix + key)

    def close(self):
        pass


def _timed(torch, fn, stream=None, reps=1):
    """Device ms of ``reps`` calls of fn, with events on ``stream`` (default: current)."""
    stream = stream or torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def _section(sub, rank, shared_gpu, name, fn):
    """Run a timed section on all ranks at once (distinct GPUs) or one rank at a time (shared GPU).

    Hardware reason: processes sharing one GPU without MPS are time-sliced, not concurrent, so
    "both at once" on one GPU would measure context switches, not DWDP.
    """
    if not shared_gpu:
        sub.barrier(name)
        return fn()
    out = None
    for r in range(sub.world_size):
        sub.barrier(f"{name}/{r}")
        if r == rank:
            out = fn()
    sub.barrier(f"{name}/end")
    return out


def _variant(torch, rdzv, rank, args, dev, transfer, contention_opt, tag, want_timeline, shared_gpu):
    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.manager import DwdpManager

    E, H, I, L = args.experts, args.hidden, args.inter, args.layers
    d = rdzv.world_size
    k = -(-E // d)
    s = -(-(E - k) // (d - 1))
    cfg = DwdpConfig(dwdp_size=d, num_experts=E, num_experts_per_worker=k, num_prefetch_experts=s,
                     contention_opt=contention_opt, transfer=transfer)
    sub = _Prefixed(rdzv, f"{tag}/")
    res = {"transfer": transfer, "contention_opt": contention_opt}
    try:
        mgr = DwdpManager.create(config=cfg, rank=rank, rendezvous=sub, backend="posix_fd", device=dev,
                                 token=args.token)
    except Exception as exc:  # noqa: BLE001 - sm_gather refusal is a result, not a crash
        res["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        sub.barrier("refused")
        return res
    shapes = {"gate_up_proj": (2 * I, H), "down_proj": (H, I)}
    dt = torch.bfloat16

    def fill(view, a, b):
        view.normal_()

    with mgr:
        a, b = mgr.local_range
        for l in range(L):
            mgr.add_layer(l)
            for n, shp in shapes.items():
                mgr.add_expert_weight(l, n, expert_shape=shp, dtype=dt, fill=fill)
        mgr.setup()
        st = mgr.streams
        comps = [mgr.buffer.tensors(l) for l in range(L)]
        compiled = [mgr.buffer.compiled_copies(l) for l in range(L)]
        bytes_fwd = sum(c.nbytes for c in compiled)
        res["remote_MiB_per_layer"] = bytes_fwd / L / 2**20
        res["copies_per_layer"] = sum(len(c.triples) for c in compiled) / L
        F = args.forwards

        def prefetch_only():
            mgr.start_forward()
            for l in range(L):
                mgr.wait_and_bind(l)
                mgr.finish_layer(l)

        # --- prefetch alone (both ranks at once) ---
        for _ in range(2):
            prefetch_only()
        torch.cuda.synchronize()
        t_pref = _section(sub, rank, shared_gpu, "pref", lambda: _timed(torch, prefetch_only, reps=F) / F)
        res["prefetch_GBps"] = bytes_fwd / (t_pref * 1e-3) / 1e9

        # --- plain copy_ of the same (dst, src, n) list on a side stream ---
        side = torch.cuda.Stream(device=dev)
        plain_dst = torch.empty(max(sum(n for _, _, n in c.triples) for c in compiled), dtype=torch.uint8,
                                device=dev)
        pairs = []
        for c in compiled:
            off = 0
            for _, src, n in c.triples:
                pairs.append((plain_dst[off:off + n], mgr.memory.as_tensor(src, (n,), torch.uint8)))
                off += n

        def plain_copy():
            with torch.cuda.stream(side):
                for dst_t, src_t in pairs:
                    dst_t.copy_(src_t, non_blocking=True)

        plain_copy()
        torch.cuda.synchronize()
        t_plain = _section(sub, rank, shared_gpu, "plain", lambda: _timed(torch, plain_copy, stream=side, reps=F) / F)
        res["copy__GBps"] = bytes_fwd / (t_plain * 1e-3) / 1e9
        res["prefetch_over_copy_"] = res["prefetch_GBps"] / res["copy__GBps"]

        # --- compute alone, token count calibrated so compute ≈ prefetch per layer ---
        def make_inputs(T):
            per = max(T // E, 1)
            offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * per
            x = torch.randn(per * E, H, device=dev, dtype=dt)
            return x, offs

        inputs = make_inputs(E)

        def moe(l, x, offs):
            w = comps[l]
            h = torch._grouped_mm(x, w["gate_up_proj"].transpose(-2, -1), offs=offs)
            act = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
            return torch._grouped_mm(act, w["down_proj"].transpose(-2, -1), offs=offs)

        def compute_only():
            for l in range(L):
                moe(l, *inputs)

        def overlapped():
            mgr.start_forward()
            for l in range(L):
                mgr.wait_and_bind(l)
                moe(l, *inputs)
                mgr.finish_layer(l)

        hp = torch.cuda.Stream(device=dev, priority=-1)  # higher priority than the copy stream (0)

        def overlapped_hp():
            with torch.cuda.stream(hp):
                overlapped()
                torch.cuda.synchronize()
                return _timed(torch, overlapped, stream=hp, reps=F) / F

        if args.tokens:
            sizes = [int(t) for t in args.tokens.split(",")]
        else:
            # calibrate: the sweep point whose compute time is closest to the prefetch time, plus a
            # compute-bound point (≥ 256 tokens per expert: grouped GEMM past the HBM roofline).
            sweep = {}
            for T in (512, 1024, 2048, 4096, 8192, 16384, 32768):
                inputs = make_inputs(T)
                moe(0, *inputs)
                sweep[T] = _section(sub, rank, shared_gpu, f"sweep{T}",
                                    lambda: _timed(torch, compute_only, reps=2) / 2)
            best = min(sweep, key=lambda T: abs(sweep[T] - t_pref))
            sizes = sorted({best, 256 * E})
            res["compute_sweep_ms_per_layer"] = {T: v / L for T, v in sweep.items()}
        res["runs"] = []
        for T in sizes:
            inputs = make_inputs(T)
            compute_only()
            overlapped()
            torch.cuda.synchronize()
            t_comp = _section(sub, rank, shared_gpu, f"comp{T}", lambda: _timed(torch, compute_only, reps=F) / F)
            t_over = _section(sub, rank, shared_gpu, f"over{T}", lambda: _timed(torch, overlapped, reps=F) / F)
            t_over_hp = _section(sub, rank, shared_gpu, f"overhp{T}", overlapped_hp)
            res["runs"].append(dict(tokens_per_layer=int(inputs[1][-1]), compute_ms_per_layer=t_comp / L,
                                    overlap_ms_per_layer=t_over / L, overlap_hp_ms_per_layer=t_over_hp / L,
                                    overlap_ratio=t_over / max(t_comp, t_pref),
                                    overlap_hp_ratio=t_over_hp / max(t_comp, t_pref)))
        res.update(prefetch_ms_per_layer=t_pref / L, plain_copy_ms_per_layer=t_plain / L)

        # --- bind cost: DWDP bind vs naive merge into one contiguous buffer ---
        torch.cuda.synchronize()

        def bind_loop():
            binds, bind_s = 0, 0.0
            for _ in range(F):
                mgr.start_forward()
                for l in range(L):
                    t0 = time.perf_counter()
                    mgr.wait_and_bind(l)
                    bind_s += time.perf_counter() - t0
                    binds += 1
                    mgr.finish_layer(l)
            torch.cuda.synchronize()
            return bind_s / binds

        bind_loop()
        res["bind_host_us"] = 1e6 * _section(sub, rank, shared_gpu, "bind", bind_loop)
        merged = {n: torch.empty((E, *shp), dtype=dt, device=dev) for n, shp in shapes.items()}

        def naive_bind(l):
            # "merge local + remote": every expert, local ones included, lands in one contiguous buffer
            for n, t in comps[l].items():
                merged[n][:a].copy_(t[:a], non_blocking=True)
                merged[n][a:b].copy_(t[a:b], non_blocking=True)
                merged[n][b:].copy_(t[b:], non_blocking=True)
            return merged

        def naive_loop():
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            for _ in range(F):
                for l in range(L):
                    naive_bind(l)
            host = time.perf_counter() - t0  # enqueue only, before waiting for the device
            e1.record()
            e1.synchronize()
            return 1e6 * host / (F * L), e0.elapsed_time(e1) / (F * L)

        naive_bind(0)
        torch.cuda.synchronize()
        res["naive_bind_host_us"], res["naive_bind_device_ms"] = _section(sub, rank, shared_gpu, "naive", naive_loop)
        eb_sum = sum(2 * I * H * 2 if n == "gate_up_proj" else H * I * 2 for n in shapes)
        res["naive_local_bytes_per_layer"] = (b - a) * eb_sum
        res["dwdp_local_bytes_per_layer"] = 0  # the local handle is mapped, never copied
        res["dwdp_copied_bytes_per_layer"] = bytes_fwd / L
        res["steady_synchronize"] = st.stats["synchronize"]

        # --- timeline of one forward (compute vs copy per layer) ---
        if want_timeline:
            layer_of = {id(c): l for l, c in enumerate(compiled)}
            cur = torch.cuda.current_stream()
            base = torch.cuda.Event(enable_timing=True)
            marks = {"compute": [], "copy": []}
            pool = [torch.cuda.Event(enable_timing=True) for _ in range(8 * L + 8)]
            real = st.enqueue_copies

            def traced(c):
                e0, e1 = pool.pop(), pool.pop()
                e0.record(st.copy_stream)
                real(c)
                e1.record(st.copy_stream)
                marks["copy"].append((layer_of.get(id(c), -1), e0, e1))

            st.enqueue_copies = traced
            torch.cuda.synchronize()
            base.record(cur)
            mgr.start_forward()
            for l in range(L):
                mgr.wait_and_bind(l)
                e0, e1 = pool.pop(), pool.pop()
                e0.record(cur)
                moe(l, *inputs)
                e1.record(cur)
                marks["compute"].append((l, e0, e1))
                mgr.finish_layer(l)
            torch.cuda.synchronize()
            st.enqueue_copies = real
            res["timeline"] = {kind: [(l, base.elapsed_time(e0), base.elapsed_time(e1)) for l, e0, e1 in rows]
                               for kind, rows in marks.items()}
        sub.barrier("done")
    return res


def _rank(rank, world, port, args, q):
    try:
        import torch

        from dwdp_runtime.rendezvous import StoreRendezvous

        ngpu = torch.cuda.device_count()
        shared_gpu = ngpu < world
        dev = torch.device("cuda", 0 if shared_gpu else rank)
        torch.cuda.set_device(dev)
        out = {"device": str(dev), "gpu": torch.cuda.get_device_name(dev), "variants": []}
        with StoreRendezvous(host="127.0.0.1", port=port, rank=rank, world_size=world, job="bench",
                             token=args.token, timeout_s=300) as rdzv:
            for i, (transfer, copt) in enumerate(VARIANTS):
                if args.only and transfer not in args.only.split(","):
                    continue
                want_tl = rank == 0 and i == 0
                out["variants"].append(_variant(torch, rdzv, rank, args, dev, transfer, copt, f"v{i}", want_tl,
                                                 shared_gpu))
        q.put((rank, "ok", out))
    except BaseException as exc:  # noqa: BLE001
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _fmt(v, nd=2):
    return "n/a" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def table(results: dict, meta: dict) -> str:
    world = len(results)
    mode = "one rank at a time (shared GPU: processes are time-sliced)" if meta["shared_gpu"] else "all ranks at once"
    lines = [f"DWDP prefetch bench — {meta['gpu']} ×{meta['ngpu']} visible, {world} ranks on {meta['devices']}, "
             f"{meta['date']}; timed sections: {mode}",
             f"layers={meta['layers']} experts={meta['experts']} hidden={meta['hidden']} inter={meta['inter']} "
             f"bf16, d={world}; values are 'rank0 / rank1 …'",
             "",
             "| transfer | contention_opt | remote MiB/layer | copies/layer | prefetch GB/s | copy_ GB/s | "
             "prefetch÷copy_ (goal ≥0.95) | bind host µs (goal <10) | naive merge host µs | naive merge device ms "
             "| local bytes copied DWDP / naive |",
             "|" + "---|" * 11]
    over = ["", "| transfer | contention_opt | tokens/layer | compute ms/layer | prefetch ms/layer | "
            "overlap ms/layer | overlap÷max(compute, prefetch) (goal ≤1.10) | same, compute on hi-prio stream |",
            "|" + "---|" * 8]
    for i in range(len(results[0]["variants"])):
        rows = [results[r]["variants"][i] for r in range(world)]
        v0 = rows[0]
        if "error" in v0:
            lines.append(f"| {v0['transfer']} | {v0['contention_opt']} | refused at setup: {v0['error']} |"
                         + " |" * 8)
            continue

        def j(key, nd=2, src=rows):
            return " / ".join(_fmt(r.get(key), nd) for r in src)

        lines.append(
            f"| {v0['transfer']} | {v0['contention_opt']} | {_fmt(v0['remote_MiB_per_layer'], 0)} | "
            f"{_fmt(v0['copies_per_layer'], 0)} | {j('prefetch_GBps', 0)} | {j('copy__GBps', 0)} | "
            f"{j('prefetch_over_copy_')} | {j('bind_host_us', 1)} | {j('naive_bind_host_us', 1)} | "
            f"{j('naive_bind_device_ms', 3)} | 0 / {v0['naive_local_bytes_per_layer'] / 2**20:.0f} MiB |")
        for k in range(len(v0["runs"])):
            runs = [r["runs"][k] for r in rows]
            over.append(
                f"| {v0['transfer']} | {v0['contention_opt']} | {j('tokens_per_layer', 0, runs)} | "
                f"{j('compute_ms_per_layer', 3, runs)} | {j('prefetch_ms_per_layer', 3)} | "
                f"{j('overlap_ms_per_layer', 3, runs)} | {j('overlap_ratio', 2, runs)} | "
                f"{j('overlap_hp_ratio', 2, runs)} |")
    return "\n".join(lines + over)


def plot_timeline(tl: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 2.8))
    for row, (kind, color) in enumerate((("compute", "tab:blue"), ("copy", "tab:orange"))):
        for l, t0, t1 in tl[kind]:
            ax.broken_barh([(t0, max(t1 - t0, 1e-3))], (row * 10 + 1, 8), facecolors=color, edgecolor="k", lw=0.3)
            ax.text((t0 + t1) / 2, row * 10 + 5, str(l), ha="center", va="center", fontsize=7)
    ax.set_yticks([5, 15], ["compute (MoE layer)", "copy (prefetch of layer)"])
    ax.set_xlabel("ms since forward start")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--forwards", type=int, default=10)
    ap.add_argument("--tokens", default="", help="comma-separated tokens per layer (default: calibrate)")
    ap.add_argument("--only", default="", help="comma-separated transfers to run")
    ap.add_argument("--token", default="bench-token")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    import torch

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    deadline = time.monotonic() + 540
    while len(results) + len(errors) < args.world and time.monotonic() < deadline:
        try:
            rank, status, value = q.get(timeout=1)
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs) and q.empty():
                break
            continue
        (results if status == "ok" else errors)[rank] = value
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors or len(results) < args.world:
        for r, e in errors.items():
            print(f"rank {r} failed:\n{e}", file=sys.stderr)
        print(f"bench incomplete: {len(results)}/{args.world} ranks reported", file=sys.stderr)
        return 1
    ngpu = torch.cuda.device_count()
    meta = {"gpu": results[0]["gpu"], "ngpu": ngpu, "devices": ",".join(results[r]["device"] for r in range(args.world)),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layers": args.layers,
            "experts": args.experts, "hidden": args.hidden, "inter": args.inter, "shared_gpu": ngpu < args.world}
    text = table(results, meta)
    print(text)
    with open(os.path.join(args.out, "prefetch.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "prefetch.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1, default=str)
    tl = results[0]["variants"][0].get("timeline")
    if tl:
        v0 = results[0]["variants"][0]
        plot_timeline(tl, os.path.join(args.out, "timeline.png"),
                      f"rank 0, {v0['transfer']}, contention_opt={v0['contention_opt']}, {meta['gpu']}, "
                      f"{meta['devices']}, {meta['date']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
