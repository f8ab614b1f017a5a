"""KV handoff, measured side by side in one run (reports, never asserts):

  1. the pull, three ways between the same two processes (a context process holding a KV service, its
     region registered once, and a decode process), for each transport setting (``--configs``):
       ours    the reference client's pull (``kv.client.KvPuller``: claim → READ → verdict); its READ's GB/s
               (post → DONE) and the whole pull's milliseconds (claim + destination registration + READ +
               verdict);
       raw     a plain NIXL READ of the same blocks by a second agent of the decode process (destination
               registered once, no claim, no notification, no verdict): the transport alone;
       copy    a device copy of the same bytes inside the context process (``copy_``: the copy engine on
               CUDA, memcpy on CPU): the ceiling a same-node transport can reach;
     with the UCX protocol that carried each READ (``UCX_PROTO_INFO=used`` into ``UCX_LOG_FILE``: the
     "remote memory read by ucp_get*" table of each agent, rows actually used) and the endpoint's lanes
     (``UCX_LOG_LEVEL=info``);
  2. prefill time added by keeping the cache: on the unsharded model (plain transformers, the same cache
     path the engine runs), packed prefill without a cache vs with the model's cache vs with the cache
     copied into a KV region, ratios to the no-cache prefill.

Configs (CUDA; on CPU only ``default`` means anything):
  default        what a rank runs: region ``cuda_malloc``, ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on`` (kv.nixl_api)
  ucx-auto       UCX's own heuristic (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto``): no cuda_ipc GET without NVLink
  torch-region   the region from PyTorch's caching allocator (``DWDP_KV_REGION_MEMORY=torch``)
  expandable     ``torch-region`` under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (VMM, POSIX-fd)

CPU:  python bench/kv_handoff.py
GPU:  python bench/kv_handoff.py --device cuda:0 --sizes-mib 32,256 --hidden-size 1024 --isl 2048
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import statistics
import sys
import tempfile
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.ranks import sync_device  # noqa: E402
from bench.ucx_report import read_lanes, read_protocols  # noqa: E402

#: per config: the environment both processes start with (on top of this process's)
CONFIGS = {
    "default": {},
    "ucx-auto": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "auto"},
    "torch-region": {"DWDP_KV_REGION_MEMORY": "torch"},
    "expandable": {"DWDP_KV_REGION_MEMORY": "torch", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}
BLOCK_BYTES = 1 << 20
HEADS, DIM = 8, 128          # one layer of fp16 key + value: seq = bytes / (8 × 128 × 2 B × 2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sizes-mib", default="1,16,128", help="stream sizes to pull (MiB)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated of {', '.join(CONFIGS)} (default: all on CUDA, default on CPU)")
    p.add_argument("--skip-prefill", action="store_true", help="only the pull comparison")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--isl", type=int, default=512, help="tokens per prompt (4 prompts packed)")
    return p.parse_args(argv)


# -- the context process ------------------------------------------------------------------------------------
def _context(conn, device, budget):
    import torch

    from dwdp_worker.kv.service import KvService, KvSettings, RankIdentity

    svc = KvService.start(KvSettings(budget_bytes=budget, block_bytes=BLOCK_BYTES), device=device,
                          identity=RankIdentity(job="bench"))
    region = svc.store.region
    conn.send(("ready", region.memory.value if region.mem == "VRAM" else "host", os.getpid()))
    n = 0
    g = torch.Generator(device=device).manual_seed(0)
    while True:
        msg = conn.recv()
        if msg is None:
            svc.close()
            conn.send("closed")
            return
        if msg[0] == "keep":
            seq = msg[1] // (HEADS * DIM * 2 * 2)
            k = torch.randn(1, HEADS, seq, DIM, generator=g, device=device).half()
            n += 1
            conn.send(svc.keep(f"b{n}", [(k, -k)], seq).model_dump(mode="json"))
        elif msg[0] == "copy":                      # a plain device copy of the same number of bytes
            _, nbytes, iters = msg
            src, dst = region.buffer[:nbytes], torch.empty(nbytes, dtype=torch.uint8, device=device)
            times = []
            for _ in range(iters + 1):
                sync_device(device)
                t = time.perf_counter()
                dst.copy_(src)
                sync_device(device)
                times.append(time.perf_counter() - t)
            conn.send(statistics.median(times[1:]))


# -- the decode process -------------------------------------------------------------------------------------
def _raw_read(agent, remote, params, dst, mem):
    """One NIXL READ of ``params``' blocks into the registered ``dst``: seconds post → DONE."""
    from dwdp_worker.kv.blocks import runs

    region, bb = params["region"], params["region"]["block_bytes"]
    local, remote_descs, pos = [], [], 0
    dev = dst.device.index or 0
    for first, count in runs(params["remote_block_ids"]):
        local.append((dst.data_ptr() + pos, count * bb, dev))
        remote_descs.append((region["base_addr"] + first * bb, count * bb, region["device_id"]))
        pos += count * bb
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, mem),
                                   agent.get_xfer_descs(remote_descs, region["mem"]), remote)
    t = time.perf_counter()
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    took = time.perf_counter() - t
    handle.release()
    if state != "DONE":
        raise RuntimeError(f"raw READ ended {state}")
    return took


def _decode(conn, device):
    import torch

    from dwdp_worker.kv.client import KvPuller
    from dwdp_worker.kv.nixl_api import new_agent, unb64

    puller = KvPuller(device=device)
    raw = new_agent(f"dwdp-raw-{uuid.uuid4().hex[:8]}")
    mem = "VRAM" if device.startswith("cuda") else "DRAM"
    remotes, buffers = set(), {}
    conn.send(("ready", puller.name, raw.name if hasattr(raw, "name") else None, os.getpid()))
    while True:
        msg = conn.recv()
        if msg is None:
            puller.close()
            del raw                                  # agents destroyed: UCX writes its "used" protocol tables
            conn.send("closed")
            return
        params = msg
        if params["remote_engine_id"] not in remotes:
            raw.add_remote_agent(unb64(params["remote_agent_metadata"]))
            remotes.add(params["remote_engine_id"])
        size = len(params["remote_block_ids"]) * params["region"]["block_bytes"]
        if size not in buffers:                      # registered once per size, as an engine's own buffer
            dst = torch.empty(size, dtype=torch.uint8, device=device)
            buffers[size] = (dst, raw.register_memory([dst]))
        dst = buffers[size][0]
        raw_s = _raw_read(raw, params["remote_engine_id"], params, dst, mem)
        t = time.perf_counter()
        pulled = puller.pull(params)
        total = time.perf_counter() - t
        sync_device(device)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for pair in pulled.kv for t in pair])
        same = bool(torch.equal(flat, dst[:flat.numel()])) if pulled.kv[0][0].is_contiguous() else None
        conn.send({"raw_s": raw_s, "read_s": pulled.read_s, "total_s": total, "claim_s": pulled.claim_s,
                   "register_s": pulled.register_s, "verdict_s": pulled.verdict_s, "same_bytes": same})


# -- one config: two fresh processes --------------------------------------------------------------------------
#: bound on one answer from a bench process (a 256 MiB READ over TCP at 0.4 GB/s is under a second)
ANSWER_S = 120.0


class BenchProcessDied(RuntimeError):
    pass


def _recv(conn, proc, what: str):
    deadline = time.monotonic() + ANSWER_S
    while not conn.poll(0.2):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise BenchProcessDied(f"the {what} process {'exited ' + str(proc.exitcode) if not proc.is_alive() else 'hung'}"
                                   " (its traceback is above)")
    return conn.recv()


def run_config(name: str, args, sizes: list[int]) -> dict:
    from dwdp_worker.kv.nixl_api import apply_ucx_defaults

    logdir = pathlib.Path(tempfile.mkdtemp(prefix=f"kv-bench-{name}-"))
    env = {**CONFIGS[name], "UCX_PROTO_INFO": "used", "UCX_LOG_LEVEL": "info",
           "UCX_LOG_FILE": str(logdir / "ucx.%p.log")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)                           # spawned children start with this environment
    try:
        ctx = mp.get_context("spawn")
        c_conn, c_child = ctx.Pipe()
        d_conn, d_child = ctx.Pipe()
        context = ctx.Process(target=_context, args=(c_child, args.device, 2 * max(sizes) + (64 << 20)), daemon=True)
        decode = ctx.Process(target=_decode, args=(d_child, args.device), daemon=True)
        context.start()
        decode.start()
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    try:
        _, region_memory, _ = _recv(c_conn, context, "context")
        _, ours_agent, _, _ = _recv(d_conn, decode, "decode")
        rows = _measure(args, sizes, c_conn, context, d_conn, decode)
        d_conn.send(None)
        _recv(d_conn, decode, "decode")
        c_conn.send(None)
        _recv(c_conn, context, "context")
    finally:
        for proc in (decode, context):
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    text = "\n".join(f.read_text(errors="replace") for f in sorted(logdir.glob("ucx.*.log")))

    protocols, lanes = read_protocols(text), read_lanes(text)
    # (measured rows above; UCX wrote its "used" tables when the agents were destroyed)
    ours = protocols.pop(ours_agent, ["(no UCX read table: see the log)"])
    raw = next((v for k, v in protocols.items() if k.startswith("dwdp-raw-")), ["(no UCX read table)"])
    return {"name": name, "rows": rows, "region": region_memory, "ours": ours, "raw": raw,
            "lanes": lanes.get(ours_agent, []), "ucx_env": apply_ucx_defaults(dict(os.environ, **CONFIGS[name]),
                                                                             cuda=args.device.startswith("cuda")),
            "log": str(logdir)}


def _measure(args, sizes, c_conn, context, d_conn, decode) -> list[dict]:
    rows = []
    for size in sizes:
        got = []
        for _ in range(args.iters + 1):
            c_conn.send(("keep", size))
            d_conn.send(_recv(c_conn, context, "context"))
            got.append(_recv(d_conn, decode, "decode"))
        c_conn.send(("copy", size, args.iters))
        copy_s = _recv(c_conn, context, "context")
        got = got[1:]                                # the first of each size connects and registers
        med = {k: statistics.median(r[k] for r in got) for k in ("raw_s", "read_s", "total_s", "register_s",
                                                                   "verdict_s", "claim_s")}
        rows.append({"size": size, "copy_s": copy_s, "same_bytes": all(r["same_bytes"] is not False for r in got),
                     **med})
    return rows


def bench_pull(args):
    sizes = [int(s) << 20 for s in args.sizes_mib.split(",")]
    names = args.configs.split(",") if args.configs else (list(CONFIGS) if args.device.startswith("cuda")
                                                           else ["default"])
    print(f"\nKV pull, three ways between the same two processes ({args.device}, median of {args.iters}); GB/s = "
          f"bytes / (READ posted → DONE); 'pull ms' = claim + destination registration + READ + verdict")
    for name in names:
        try:
            res = run_config(name, args, sizes)
        except BenchProcessDied as exc:
            print(f"\n[{name}] not measured: {exc}")
            continue
        ucx = {k: v for k, v in res["ucx_env"].items() if k not in ("UCX_LOG_FILE", "UCX_PROTO_INFO", "UCX_LOG_LEVEL")}
        print(f"\n[{name}] region {res['region']}, UCX {ucx or '(defaults)'}, "
              f"PYTORCH_CUDA_ALLOC_CONF={CONFIGS[name].get('PYTORCH_CUDA_ALLOC_CONF', os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))!r}")
        print(f"{'stream':>8} | {'ours GB/s':>9} {'pull ms':>8} {'(claim reg verdict ms)':>24} | {'raw GB/s':>8} | "
              f"{'copy GB/s':>9} | same bytes")
        for r in res["rows"]:
            mib = r["size"] >> 20
            print(f"{mib:>4} MiB | {r['size'] / r['read_s'] / 1e9:>9.2f} {r['total_s'] * 1e3:>8.2f} "
                  f"({r['claim_s'] * 1e3:6.2f} {r['register_s'] * 1e3:6.2f} {r['verdict_s'] * 1e3:6.2f})    | "
                  f"{r['size'] / r['raw_s'] / 1e9:>8.2f} | {r['size'] / r['copy_s'] / 1e9:>9.2f} | {r['same_bytes']}")
        print(f"  transport, ours: {'; '.join(res['ours'])}")
        print(f"  transport, raw:  {'; '.join(res['raw'])}")
        print(f"  transport, copy: {'cudaMemcpy device-to-device (copy engine), no UCX' if args.device.startswith('cuda') else 'memcpy, no UCX'}")
        for lane in res["lanes"]:
            print(f"  endpoint lanes (ours): {lane}")
        print(f"  UCX log: {res['log']}")


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

    def no_cache():
        packed_logits(model, prompts, args.device)

    def with_cache():
        cached_prefill(model, prompts, args.device)
        sync_device(args.device)

    n = [0]

    def keep_kv():
        _, per_seq = cached_prefill(model, prompts, args.device)
        for kv in per_seq:
            n[0] += 1
            store.put(f"p{n[0]}", kv, args.isl)
            store.discard(f"p{n[0]}")
        sync_device(args.device)

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
    store.region.close()


def main(argv=None):
    args = parse_args(argv)
    bench_pull(args)
    if not args.skip_prefill:
        bench_prefill(args)


if __name__ == "__main__":
    main()
