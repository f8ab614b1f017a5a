"""The checkpoint read into GPU memory alone, ÷ the page-cache read rate of the same files (reports; issue #34).

``bench/cold_start.py`` times ``read_s`` inside a rank's start: the reads plus everything the loader does between
them (allocating the dense parameters and the expert handles, resolving names, progress). This bench isolates the
reads: every tensor of the checkpoint gets its destination in GPU memory first (not timed), then all are read
through ``SafetensorsIndex`` (``checkpoint.device_staging``: pinned slots, queued copies, ``pread`` pieces over
threads) and drained, for each ``--threads`` value, beside the page-cache rate of the same files (one thread,
64 MiB reads, as cold_start.py measures it). Each tensor read is compared with the CPU read once (bitwise).

Run on a GPU:   python bench/staging_read.py --model DIR [--threads 1 2 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from bench.cold_start import page_cache_rate  # noqa: E402

#: passes per setting: the first warms the pinned slots and the threads, the best of the rest is reported
PASSES = 3


def read_all(index, dsts: dict) -> float:
    """Seconds to read every tensor into its GPU destination and drain the queued copies."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for key, dst in dsts.items():
        index._read_direct(index.entries[key], 0, index.entries[key].nbytes, dst)
    index.drain()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=pathlib.Path, required=True)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json", type=pathlib.Path)
    args = ap.parse_args(argv)

    import torch

    from dwdp_worker.checkpoint.device_staging import DeviceStager
    from dwdp_worker.checkpoint.safetensors_index import SafetensorsIndex

    if not torch.cuda.is_available():
        print("bench/staging_read.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    cache_rate, size = page_cache_rate(args.model)
    print(f"checkpoint {args.model}: {size / 2**20:.1f} MiB, page-cache read {cache_rate:.2f} GB/s (one thread)",
          flush=True)
    rows = []
    with SafetensorsIndex(args.model) as index:
        dsts = {k: torch.empty(e.shape, dtype=e.dtype, device=dev) for k, e in index.entries.items()}
        total = sum(e.nbytes for e in index.entries.values())
        sizes = sorted(e.nbytes for e in index.entries.values())
        print(f"{len(dsts)} tensors, median {sizes[len(sizes) // 2] / 2**20:.2f} MiB, largest {sizes[-1] / 2**20:.1f} MiB",
              flush=True)
        for threads in args.threads:
            index._stagers[dev] = DeviceStager(dev, read_threads=threads)
            times = [read_all(index, dsts) for _ in range(PASSES)]
            index._stagers.pop(dev).close()
            best = min(times[1:])
            rate = total / best / 1e9
            rows.append(dict(threads=threads, seconds=best, gb_s=rate, vs_page_cache=rate / cache_rate))
            print(f"threads {threads}: {best * 1e3:7.1f} ms = {rate:5.2f} GB/s = {rate / cache_rate:.2f}x the page "
                  f"cache (passes: {', '.join(f'{t * 1e3:.0f}' for t in times)} ms)", flush=True)
        bad = [k for k, d in dsts.items() if not torch.equal(d.cpu(), index.get(k))]
        print(f"bitwise equal to the CPU read: {not bad}" + (f" (differ: {bad[:3]})" if bad else ""), flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(page_cache_gb_s=cache_rate, bytes=total, rows=rows, bitwise=not bad)))
    return 0 if not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
