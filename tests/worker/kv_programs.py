"""Programs for the KV handoff tests (importable by spawned processes).

``prefill_program`` is one DWDP rank: for each checkpoint it builds an Engine with a KV budget (one store port
per run, each checked free by the test: rank 0's store of the previous run may still be closing, and a port
derived from another one can be any process's ephemeral port — seen in CI as EADDRINUSE for 180 s), prefills
the packed prompts keeping their KV, writes the transfer params (JSON) into ``exchange`` and waits (bounded)
until the decode process says it is done; it also decodes the prompts itself (``max_new_tokens``) so the
engine's own cache path is checked. ``decode_program`` is the separate decode process: its own NIXL agent
(the reference client) pulls every rank's KV, continues with plain transformers, and compares against the
unsharded model (K/V bitwise against its packed cached prefill, tokens against ``generate``).
"""

from __future__ import annotations

import json
import pathlib
import time

WAIT_S = 120.0


def _wait_for(path: pathlib.Path, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.02)


def _write(path: pathlib.Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)


def prefill_program(rank, world, port, *, runs, store_ports, prompts, exchange, new_tokens, block_bytes=4096,
                    budget_bytes=1 << 20):
    import torch

    torch.set_num_threads(1)
    from dwdp_runtime.config import DwdpConfig
    from dwdp_worker.rank.engine import Engine, num_experts_of
    from dwdp_worker.kv.service import KvSettings, RankIdentity
    from .programs import _rdzv

    exchange = pathlib.Path(exchange)
    out = {}
    for job, model_dir in runs:
        cfg = DwdpConfig.even(dwdp_size=world, num_experts=num_experts_of(model_dir))
        with _rdzv(rank, world, store_ports[job], job) as rdzv:
            engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend="host",
                                  token="tok", progress=False,
                                  kv=KvSettings(budget_bytes=budget_bytes, block_bytes=block_bytes),
                                  identity=RankIdentity(job=job, rank=rank))
            try:
                res = engine.generate(prompts, keep_kv=[f"{job}-r{rank}-{i}" for i in range(len(prompts))],
                                      model_name=job)
                params = [o.kv_params.model_dump(mode="json") for o in res.outputs]
                first = [o.tokens[0] for o in res.outputs]
                decoded = engine.generate(prompts, max_new_tokens=[new_tokens] * len(prompts))
                plain = engine.forward(prompts).logits
                same_logits = all(torch.equal(o.logits[0], plain[i]) for i, o in enumerate(res.outputs)) and \
                    all(torch.equal(o.logits[0], plain[i]) for i, o in enumerate(decoded.outputs))
                _write(exchange / f"{job}-r{rank}.json", {"params": params, "first": first})
                full = _fill_until_full(engine, prompts, job)
                _wait_for(exchange / f"{job}-done")
                out[job] = {"first": first, "decoded": [o.tokens for o in decoded.outputs],
                            "same_logits": same_logits, "full": full, "stats": engine.stats()}
            finally:
                engine.close()
    return out


def _fill_until_full(engine, prompts, job):
    """Keep KV until the budget refuses a sequence; the refused one gets ``kv_error``, the batch still answers."""
    kept, errors, peak = [], [], 0
    for n in range(1000):
        res = engine.generate(prompts, keep_kv=[f"{job}-fill{n}-{i}" for i in range(len(prompts))])
        for i, o in enumerate(res.outputs):
            (errors if o.kv_error else kept).append(o.kv_error or f"{job}-fill{n}-{i}")
        peak = max(peak, engine.kv.stats().held_bytes)
        if errors:
            break
    for rid in kept:
        engine.kv.store.discard(rid)
    return {"errors": errors, "kept": len(kept), "peak": peak, "budget": engine.kv.stats().budget_bytes,
            "full_total": engine.kv.stats().full_total, "held_after": engine.kv.stats().held_bytes}


def decode_program(*, runs, world, prompts, exchange, new_tokens, result):
    import torch

    torch.set_num_threads(1)
    from dwdp_worker.kv.prefill import cached_prefill
    from dwdp_worker.kv.client import KvPuller, decode_from_params
    from dwdp_worker.launch.oracle import Reference

    exchange = pathlib.Path(exchange)
    report = {}
    with KvPuller() as puller:
        for job, model_dir in runs:
            ref = Reference(model_dir)
            _, ref_kv = cached_prefill(ref.model, prompts, "cpu")
            with torch.inference_mode():
                expected = [ref.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                               pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
                            for p in prompts]
            per_rank = {}
            for rank in range(world):
                f = exchange / f"{job}-r{rank}.json"
                _wait_for(f)
                got = json.loads(f.read_text())
                rows = []
                for i, (params, first) in enumerate(zip(got["params"], got["first"])):
                    pulled = puller.pull(params)
                    kv_equal = all(torch.equal(a, c) and torch.equal(b, d)
                                   for (a, b), (c, d) in zip(pulled.kv, ref_kv[i]))
                    tokens, _ = decode_from_params(ref.model, prompts[i], first, pulled, max_new_tokens=new_tokens)
                    rows.append({"kv_equal": kv_equal, "layers": len(pulled.kv), "ref_layers": len(ref_kv[i]),
                                 "tokens": tokens, "nbytes": pulled.nbytes,
                                 "shapes": [[list(k.shape), list(v.shape)] for k, v in pulled.kv]})
                per_rank[rank] = rows
            (exchange / f"{job}-done").write_text("1")
            report[job] = {"expected": expected, "ranks": per_rank}
    pathlib.Path(result).write_text(json.dumps(report))


def open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def mapped_regions() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def kv_server_program(conn, *, budget_bytes, block_bytes, ttl_s, lease_s=30.0, grace_s=5.0, peer_idle_s=5.0):
    """A KV service on CPU in its own process, driven over a pipe: ("keep", request_id, seq_len, seed) → params
    (and the tensors kept), ("stats",) → store stats + fds + mapped regions + NIXL peers, ("stop",)."""
    import torch

    torch.set_num_threads(1)
    from dwdp_worker.kv.service import KvService, KvSettings, RankIdentity
    from dwdp_worker.kv.store import KvBudgetFull

    svc = KvService.start(KvSettings(budget_bytes=budget_bytes, block_bytes=block_bytes, ttl_s=ttl_s,
                                     lease_s=lease_s, grace_s=grace_s), device="cpu", identity=RankIdentity(job="faults"),
                          peer_idle_s=peer_idle_s)
    conn.send(("ready", svc.engine_id))
    while True:
        msg = conn.recv()
        if msg[0] == "keep":
            _, rid, seq_len, seed = msg
            g = torch.Generator().manual_seed(seed)
            kv = [(torch.randn(1, 2, seq_len, 8, generator=g), torch.randn(1, 2, seq_len, 4, generator=g))
                  for _ in range(2)]
            try:
                conn.send(("ok", svc.keep(rid, kv, seq_len, model="m").model_dump(mode="json"), kv))
            except KvBudgetFull as exc:
                conn.send(("full", str(exc), None))
        elif msg[0] == "stats":
            conn.send({**svc.stats().as_dict(), "fds": open_fds(), "maps": mapped_regions(),
                       "peers": svc.server.num_peers})
        elif msg[0] == "stop":
            svc.close()
            conn.send(("stopped", open_fds()))
            return


class KvServerProcess:
    """``kv_server_program`` in a process of its own (``tests.processes``), driven from the test over a pipe."""

    def __init__(self, **kw):
        from tests.processes import context, process

        self.conn, child = context().Pipe()
        self.proc = process(kv_server_program, (child,), kw)
        self.proc.start()
        assert self.conn.poll(120), "KV server did not start"
        self.engine_id = self.conn.recv()[1]

    def keep(self, rid, seq_len=5, seed=0):
        self.conn.send(("keep", rid, seq_len, seed))
        return self.conn.recv()

    def stats(self):
        self.conn.send(("stats",))
        return self.conn.recv()

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def stop(self):
        if self.proc.is_alive():
            self.conn.send(("stop",))
            out = self.conn.recv()
            self.proc.join(10)
            return out
        return None


def settle(server, timeout_s=10.0):
    """Stats once the last PULLED notifications are handled and idle peers unloaded (both asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = server.stats()
        if (s["held_sequences"] == 0 and s["peers"] == 0) or time.monotonic() > deadline:
            return s
        time.sleep(0.05)


# -- does a continuation follow from its cache? (teacher forcing; used by the GPU test, checked on CPU) ---------
#: the median position's max |Δlogit| a right cache stays under. Measured on the GPU test's random bf16 model (CPU,
#: 2026-12-04): ~0.05 at most positions (bf16 noise, ~5 % of the logits' std of 1.0); a position where bf16 noise
#: flips a token's top-k experts moves by up to ~1.3; a wrong cache (another sequence's, layers swapped, values
#: zeroed) moves the median position by 2.5–3.5
TF_MEDIAN_ATOL = 0.25
#: positions whose logits point the same way (cosine ≥ TF_COS) — all but the rare expert flips for a right cache
#: (≥ 0.93 even there); a wrong cache stays ≤ 0.86 at every position
TF_COS, TF_MIN_AGREEING = 0.99, 0.75


def forced_logits(model, tokens, *, cache=None, start: int = 0):
    """float32 CPU logits of one forward over ``tokens`` (after ``cache``, at positions ``start``…), no sampling."""
    import torch

    from dwdp_worker.kv.prefill import cache_kwarg

    device = next(model.parameters()).device
    ids = torch.tensor([list(tokens)], device=device)
    kw = {} if cache is None else {cache_kwarg(model): cache,
                                   "position_ids": torch.arange(start, start + len(tokens), device=device)[None]}
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=cache is not None, **kw).logits[0].float().cpu()


def teacher_forced(model, prompt, continuation):
    """The logits that should have chosen ``continuation[1:]`` (its first token came from the prefill): one
    plain forward of the prompt alone, no cache, over ``prompt + continuation[:-1]``."""
    return forced_logits(model, list(prompt) + list(continuation[:-1]))[len(prompt):]


def logit_agreement(got, reference) -> dict:
    """How closely ``got`` follows ``reference`` ([positions, vocab] each) and whether that passes."""
    import torch

    per_pos = (got - reference).abs().amax(dim=1)
    cos = torch.nn.functional.cosine_similarity(got, reference, dim=1)
    out = {"median_max_abs": float(per_pos.median()), "max_abs": float(per_pos.max()),
           "agreeing": float((cos >= TF_COS).float().mean()), "min_cos": float(cos.min())}
    out["ok"] = out["median_max_abs"] <= TF_MEDIAN_ATOL and out["agreeing"] >= TF_MIN_AGREEING
    return out


def wrong_cache(kv, other_kv):
    """A plausible wrong cache for ``kv``: another sequence's (truncated to this length) when it is long enough,
    else this one's layers rotated by one (both: right shapes, wrong content)."""
    n = kv[0][0].shape[2]
    if other_kv[0][0].shape[2] >= n:
        return [(k[:, :, :n].contiguous(), v[:, :, :n].contiguous()) for k, v in other_kv]
    return [(kv[(i + 1) % len(kv)][0].clone(), kv[(i + 1) % len(kv)][1].clone()) for i in range(len(kv))]
