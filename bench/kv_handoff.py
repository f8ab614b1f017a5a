"""KV handoff, measured side by side in one run (reports, never asserts):

  1. pull bandwidth: a KV service (its own process, region registered once) keeps streams of several
     sizes; this process pulls each with the reference client (``kv_client.KvPuller``) and reports the
     claim round trip and the READ's GB/s;
  2. prefill time added by keeping the cache: on the unsharded model (plain transformers, the same cache
     path the engine runs), packed prefill without a cache vs with the model's cache vs with the cache
     copied into a KV region, ratios to the no-cache prefill.

CPU:  python bench/kv_handoff.py
GPU:  python bench/kv_handoff.py --device cuda:0 --sizes-mib 16,256,1024 --hidden-size 1024 --isl 2048
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes-mib", default="1,16,128", help="stream sizes to pull (MiB)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--isl", type=int, default=512, help="tokens per prompt (4 prompts packed)")
    return p.parse_args(argv)


def _server(conn, device, budget):
    import torch

    from dwdp_worker.kv.service import KvService, KvSettings, RankIdentity

    svc = KvService.start(KvSettings(budget_bytes=budget), device=device, identity=RankIdentity(job="bench"))
    conn.send("ready")
    n = 0
    while True:
        msg = conn.recv()
        if msg is None:
            svc.close()
            return
        heads, seq, dim = 8, msg // (8 * 128 * 2 * 2), 128   # one layer: key + value, float16
        kv = [(torch.ones(1, heads, seq, dim, dtype=torch.float16, device=device),) * 2]
        n += 1
        conn.send(svc.keep(f"b{n}", kv, seq).model_dump(mode="json"))


def bench_pull(args):
    from dwdp_worker.kv.client import KvPuller

    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(child, args.device, 2 * max(sizes) + (64 << 20)), daemon=True)
    proc.start()
    assert conn.recv() == "ready"
    rows = []
    with KvPuller(device=args.device) as puller:
        for size in sizes:
            claims, reads, gbps = [], [], []
            for _ in range(args.iters + 1):
                conn.send(size)
                pulled = puller.pull(conn.recv())
                claims.append(pulled.claim_s)
                reads.append(pulled.read_s)
                gbps.append(pulled.read_gbps)
            rows.append((size, statistics.median(claims[1:]), statistics.median(reads[1:]),
                         statistics.median(gbps[1:])))
            time.sleep(0.05)
    conn.send(None)
    proc.join(10)
    print(f"\npull ({args.device}, median of {args.iters}):")
    print(f"{'stream':>10} {'claim ms':>9} {'READ ms':>9} {'GB/s':>7}")
    for size, c, r, g in rows:
        print(f"{size >> 20:>7} MiB {c * 1e3:>9.2f} {r * 1e3:>9.2f} {g:>7.2f}")


def bench_prefill(args):
    import torch

    from dwdp_worker.kv.prefill import cached_prefill
    from dwdp_worker.kv.region import KvRegion
    from dwdp_worker.kv.store import KvStore
    from dwdp_worker.launch.oracle import Reference
    from dwdp_worker.model.packing import packed_logits
    from dwdp_worker.checkpoint.synth import write_synthetic

    dtype = "float32" if args.device == "cpu" else "bfloat16"
    d = write_synthetic("qwen3_moe", pathlib.Path(tempfile.mkdtemp()) / "m", seed=1, dtype=dtype,
                        hidden_size=args.hidden_size, num_layers=args.num_layers, num_experts=8,
                        max_positions=max(4096, args.isl))
    model = Reference(d, device=args.device).model
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (args.isl,), generator=g).tolist() for _ in range(4)]
    store = KvStore(KvRegion(1 << 30, block_bytes=1 << 20, device=args.device))

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def no_cache():
        packed_logits(model, prompts, args.device)

    def with_cache():
        cached_prefill(model, prompts, args.device)
        sync()

    n = [0]

    def keep_kv():
        _, per_seq = cached_prefill(model, prompts, args.device)
        for kv in per_seq:
            n[0] += 1
            store.put(f"p{n[0]}", kv, args.isl)
            store.discard(f"p{n[0]}")
        sync()

    times = {}
    for name, fn in (("no cache", no_cache), ("model's cache", with_cache), ("cache kept in region", keep_kv)):
        fn()
        ts = []
        for _ in range(args.iters):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        times[name] = statistics.median(ts)
    base = times["no cache"]
    print(f"\nprefill, 4 × {args.isl} tokens packed ({args.device}, {dtype}, hidden {args.hidden_size}, "
          f"{args.num_layers} layers, median of {args.iters}):")
    for name, t in times.items():
        print(f"{name:>22}: {t * 1e3:8.2f} ms  ×{t / base:.3f}")


def main(argv=None):
    args = parse_args(argv)
    bench_pull(args)
    bench_prefill(args)


if __name__ == "__main__":
    main()
