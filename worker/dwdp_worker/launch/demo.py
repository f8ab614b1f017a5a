"""``dwdp-worker demo``: the README's one command, end to end on CPU in well under two minutes.

1. write a seeded tiny ``qwen3_moe`` checkpoint (with a small tokenizer) to a temp dir;
2. start the local launcher (``dwdp-worker --local``, G=1 × D=2 by default, host backend) as a child
   process on a free loopback port and wait for ``/readyz``;
3. send one text request and one token-id request to ``/v1/completions`` and one chat request to
   ``/v1/chat/completions``; print the answers and ``/healthz``;
4. run the same checkpoint unsharded with plain ``transformers`` (the oracle) and compare the greedy
   tokens; the demo fails (exit 1) if they differ;
5. SIGTERM the launcher (drain) and check it exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

PROMPT = "hello world the model is a group of expert layer"


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=1, help="independent DWDP groups (default 1)")
    p.add_argument("--dwdp-size", type=int, default=2, help="ranks per group (default 2)")
    p.add_argument("--arch", default="qwen3_moe", help="synthetic architecture to serve (default qwen3_moe)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens the demo request generates (default 4)")
    p.add_argument("--port", type=int, default=None, help="default: a free loopback port")
    p.add_argument("--timeout-s", type=float, default=100.0, help="give up waiting for readiness after this")


def child_env() -> dict:
    """The environment for a child ``python -m dwdp_worker.launch.cli``: this checkout's packages first."""
    import dwdp_runtime
    import dwdp_worker

    paths = [str(pathlib.Path(dwdp_worker.__file__).resolve().parents[1]),
             str(pathlib.Path(dwdp_runtime.__file__).resolve().parents[1])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return env


def greedy_reference(model_dir, tokens: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities from the unsharded transformers model."""
    import torch

    from .oracle import Reference

    ref = Reference(model_dir)
    seq, out, lps = list(tokens), [], []
    for _ in range(steps):
        logits = ref.logits([seq])[0]
        t = int(torch.argmax(logits))
        lps.append(float(torch.log_softmax(logits.float(), -1)[t]))
        out.append(t)
        seq.append(t)
    return out, lps


def _say(msg: str) -> None:
    print(msg, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    import httpx

    from dwdp_runtime.ports import free_port
    from ..checkpoint.synth import write_synthetic
    from ..front.text import encode, load_tokenizer

    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dwdp-demo-") as tmp:
        model_dir = write_synthetic(args.arch, pathlib.Path(tmp) / args.arch, seed=0, tokenizer=True)
        _say(f"[1/5] wrote a tiny synthetic {args.arch} checkpoint to {model_dir}")
        port = args.port or free_port()
        cmd = [sys.executable, "-m", "dwdp_worker.launch.cli", "--local", "--model", str(model_dir), "--groups",
               str(args.groups), "--dwdp-size", str(args.dwdp_size), "--backend", "host", "--port", str(port)]
        _say(f"[2/5] starting {args.groups} group(s) × {args.dwdp_size} ranks: dwdp-worker " + " ".join(cmd[3:]))
        log_path = pathlib.Path(tmp) / "server.log"
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(cmd, env=child_env(), stdout=log_file, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        ok = False
        try:
            with httpx.Client(base_url=base, timeout=30.0) as http:
                deadline = time.monotonic() + args.timeout_s
                while time.monotonic() < deadline:
                    if proc.poll() is not None:
                        break
                    try:
                        if http.get("/readyz").status_code == 200:
                            ok = True
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.2)
                if not ok:
                    _say("demo: the server did not become ready; its log:\n" + log_path.read_text(errors="replace"))
                    return 1
                _say(f"      ready after {time.monotonic() - t_start:.1f} s")
                req = {"prompt": PROMPT, "max_tokens": args.max_tokens, "logprobs": 2}
                _say(f"[3/5] POST /v1/completions {json.dumps(req)}")
                r = http.post("/v1/completions", json=req)
                if r.status_code != 200:
                    _say(f"demo: request failed: {r.status_code} {r.text}")
                    return 1
                ans = r.json()
                c = ans["choices"][0]
                _say(f"      text {c['text']!r}  token_ids {c['token_ids']}")
                _say(f"      logprobs {json.dumps(c['logprobs']['top_logprobs'])}")
                _say(f"      usage {json.dumps(ans['usage'])}")
                _say(f"      timings {json.dumps(ans['timings'])}")
                tokens = encode(load_tokenizer(model_dir), PROMPT)
                r2 = http.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1})
                _say(f"      same prompt as token ids {tokens}: first token {r2.json()['choices'][0]['token_ids']}")
                chat = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 2}
                r3 = http.post("/v1/chat/completions", json=chat)  # the checkpoint's chat template (synth writes one)
                if r3.status_code != 200:
                    _say(f"demo: chat request failed: {r3.status_code} {r3.text}")
                    return 1
                _say(f"      POST /v1/chat/completions {json.dumps(chat)} → "
                     f"{json.dumps(r3.json()['choices'][0]['message'])}")
                health = http.get("/healthz").json()
                health["ranks"] = [{k: v for k, v in rk.items() if k in ("global_id", "group", "rank", "phase",
                                                                         "forwards", "prefetch_bytes")}
                                   for rk in health["ranks"]]
                _say("      GET /healthz → " + json.dumps(health))
            _say("[4/5] the same checkpoint unsharded with plain transformers (the oracle)")
            want, want_lp = greedy_reference(model_dir, tokens, args.max_tokens)
            got = ans["choices"][0]["token_ids"]
            got_lp = ans["choices"][0]["logprobs"]["token_logprobs"]
            max_diff = max(abs(a - b) for a, b in zip(got_lp, want_lp))
            same = got == want and r2.json()["choices"][0]["token_ids"] == want[:1] and max_diff < 1e-3
            _say(f"      DWDP tokens {got}  transformers tokens {want}  max |Δlogprob| {max_diff:.2e} → "
                 f"{'MATCH' if same else 'MISMATCH'}")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        _say(f"[5/5] SIGTERM → the launcher drained and exited with code {code} "
             f"(total {time.monotonic() - t_start:.1f} s)")
        if code != 0:
            _say(log_path.read_text(errors="replace"))
        return 0 if (ok and same and code == 0) else 1
