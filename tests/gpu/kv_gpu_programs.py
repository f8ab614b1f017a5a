"""Programs of the GPU KV handoff test (importable by spawned processes; see test_kv_gpu.py)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import statistics
import time

from ..worker.kv_programs import _wait_for, _write, forced_logits, logit_agreement, teacher_forced, wrong_cache


def digest(kv) -> str:
    import torch

    h = hashlib.sha256()
    for k, v in kv:
        for t in (k, v):
            h.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gpu_prefill_program(rank, world, port, *, model_dir, prompts, exchange, budget_bytes, repeats, backend="cuda"):
    """Rank 0 prefills ``prompts`` on CUDA, keeping their KV in GPU memory; times the prefill with and without."""
    import torch

    from dwdp_runtime.config import DwdpConfig
    from dwdp_worker.rank.engine import Engine, num_experts_of
    from dwdp_worker.kv.prefill import cached_prefill
    from dwdp_worker.kv.service import KvSettings, RankIdentity

    from ..worker.programs import _rdzv

    exchange = pathlib.Path(exchange)
    device = f"cuda:{rank % torch.cuda.device_count()}" if backend == "cuda" else None
    cfg = DwdpConfig.even(dwdp_size=world, num_experts=num_experts_of(model_dir))
    with _rdzv(rank, world, port, "kvgpu", timeout_s=240) as rdzv:
        t0 = time.perf_counter()
        engine = Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend=backend,
                              device=device, token="tok", progress=False,
                              kv=KvSettings(budget_bytes=budget_bytes), identity=RankIdentity(job="kvgpu", rank=rank))
        build_s = time.perf_counter() - t0
        try:
            if rank != 0:
                _wait_for(exchange / "done", timeout_s=480)
                return {"build_s": build_s}
            engine.forward(prompts)                       # warm-up: kernels, prefetch schedule
            plain, kept = [], []
            for i in range(repeats):
                _sync()
                t = time.perf_counter()
                engine.forward(prompts)
                _sync()
                plain.append(time.perf_counter() - t)
                t = time.perf_counter()
                res = engine.generate(prompts, keep_kv=[f"warm{i}-{j}" for j in range(len(prompts))])
                _sync()
                kept.append(time.perf_counter() - t)
                for j in range(len(prompts)):             # free them again (never pulled)
                    engine.kv.store.discard(f"warm{i}-{j}")
            res = engine.generate(prompts, keep_kv=[f"r{j}" for j in range(len(prompts))], model_name="kvgpu")
            # the kept bytes, recomputed the same way, to check the pull bit for bit
            _, per_seq = cached_prefill(engine.model, prompts, engine.device)
            out = {"build_s": build_s, "prefill_plain_s": statistics.median(plain),
                   "prefill_keep_kv_s": statistics.median(kept),
                   "params": [o.kv_params.model_dump(mode="json") for o in res.outputs],
                   "first": [o.tokens[0] for o in res.outputs], "digests": [digest(kv) for kv in per_seq],
                   "kv_stats": engine.kv.stats().as_dict()}
            _write(exchange / "r0.json", out)
            _wait_for(exchange / "done", timeout_s=480)
            out["kv_stats_after"] = engine.kv.stats().as_dict()
            return out
        finally:
            engine.close()


def gpu_decode_program(*, model_dir, prompts, exchange, new_tokens, result, device="cuda:0"):
    """The decode side on CUDA: pull every sequence into GPU memory, check it, decode with plain transformers.

    Its unsharded model runs the same experts forward as the engine (``experts="auto"``: DWDP's Triton
    kernels on CUDA), as the GPU oracle does: DWDP must not change the math, so the pulled K/V equal this
    model's own cache bit for bit (with transformers' grouped_mm experts they differ by bf16 noise, ~2 on
    a random tiny model, measured on H200).

    The continuation is checked twice: against the same greedy decode from a cache computed here (the same
    packed prefill, the same kernels: tokens and logits bitwise), and against ``generate``'s model by teacher
    forcing (one plain forward of the prompt alone over prompt + continuation: ``logit_agreement`` within the
    bf16 tolerance of ``kv_programs``), next to the same check of a wrong cache, which must fail it."""
    import torch

    from dwdp_worker.kv.client import KvPuller, decode_from_params
    from dwdp_worker.kv.prefill import cache_from, cached_prefill, continue_greedy
    from dwdp_worker.launch.oracle import Reference

    exchange = pathlib.Path(exchange)
    try:
        model = Reference(model_dir, device=device, experts="auto").model
        _, ref_kv = cached_prefill(model, prompts, torch.device(device))
        with torch.inference_mode():
            expected = [model.generate(torch.tensor([p], device=device), max_new_tokens=new_tokens,
                                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                       eos_token_id=None)[0, len(p):].tolist() for p in prompts]
        f = exchange / "r0.json"
        _wait_for(f, timeout_s=480)
        got = json.loads(f.read_text())
        rows = []
        with KvPuller(device=device) as puller:
            for i, params in enumerate(got["params"]):
                pulled = puller.pull(params)
                _sync()
                max_diff = max(float((a.float() - c.float()).abs().max()) for (a, _), (c, _) in zip(pulled.kv, ref_kv[i]))
                first = got["first"][i]
                tokens, logits = decode_from_params(model, prompts[i], first, pulled, max_new_tokens=new_tokens)
                local = [(k.contiguous(), v.contiguous()) for k, v in ref_kv[i]]
                local_tokens, local_logits = continue_greedy(model, prompts[i], first, cache_from(model, local),
                                                             new_tokens)
                again_tokens, again_logits = decode_from_params(model, prompts[i], first, pulled,
                                                                max_new_tokens=new_tokens)
                forced = teacher_forced(model, prompts[i], tokens)
                local_forced = teacher_forced(model, prompts[i], local_tokens)
                first_diff = next((j for j, (a, b) in enumerate(zip(tokens, local_tokens)) if a != b), None)
                step_diff = [float((a - b).abs().max()) for a, b in zip(logits, local_logits)]
                bad = wrong_cache(ref_kv[i], ref_kv[(i + 1) % len(prompts)])
                bad_logits = forced_logits(model, tokens[:-1], cache=cache_from(model, bad), start=len(prompts[i]))
                rows.append({"bitwise": digest(pulled.kv) == got["digests"][i], "nbytes": pulled.nbytes,
                             "read_s": pulled.read_s, "claim_s": pulled.claim_s, "gbps": pulled.read_gbps,
                             "register_s": pulled.register_s, "verdict_s": pulled.verdict_s,
                             "device": str(pulled.kv[0][0].device), "max_diff_vs_unsharded": max_diff,
                             "tokens": tokens, "expected": expected[i], "local_tokens": local_tokens,
                             "continuation_bitwise": tokens == local_tokens and torch.equal(logits, local_logits),
                             "teacher_forced": logit_agreement(logits, forced),
                             # diagnostics of a continuation that is not bitwise: is the pulled decode itself
                             # repeatable, does the local decode follow the prompt, where do they part
                             "repeat_bitwise": again_tokens == tokens and torch.equal(again_logits, logits),
                             "local_teacher_forced": logit_agreement(local_logits, local_forced),
                             "first_token_diff": first_diff, "step_logit_diff": step_diff,
                             "wrong_cache": logit_agreement(bad_logits, forced)})
        pathlib.Path(result).write_text(json.dumps({"rows": rows}))
    finally:
        (exchange / "done").write_text("1")
