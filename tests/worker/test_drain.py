"""Drain under load: two DWDP groups (one ``dwdp-worker pod`` each, 2 ranks per pod, each group its own
store), a bounded load generator spreading requests over both on loopback, and a SIGTERM to one group's
pod mid-load (the operator scaling it down or rolling it). The SIGTERM goes out when a streamed
"witness" request on that pod has its first token, so an admitted request is in flight at the signal on
every run (timing the signal by request count alone left none in flight once on a busy CI machine).

Proves: zero failed requests on the group that stays; every request sent to the removed group is either
answered 200 (with the oracle's tokens) or refused before acceptance — a 503 with a message, or a refused
TCP connection once its listener is closed — never a reset mid-request, a 5xx other than 503, a timeout
or a lost request; the witness gets all its tokens; the removed pod exits 0.

Each client thread behaves like a Service's endpoint list: once a pod refused it (503 draining or a
closed port), its next requests go to the other group. A client that keeps opening *new* connections
to a pod after it said "draining" can still meet the instant its listener closes (Linux resets the
connections still in the accept queue); see RELIABILITY.md.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter

import httpx

from .serving_helpers import Server, free_port, greedy_reference

TOTAL = 200          # requests, bounded
WORKERS = 8          # client threads, each with its own keep-alive connection pool
DEADLINE_S = 60.0    # hard bound on the whole load run (it normally takes well under 20 s)
PROMPTS = [[4, 8, 15, 16, 23, 42], [7], [100, 3, 250, 9, 1, 2, 3, 4], [11, 12]]
# The witness: a streamed request with many decode steps. The SIGTERM goes out when its first token
# arrives (so the pod has admitted it) and the rest must still arrive: the "admitted requests finish"
# half of the drain is exercised on every run, however fast or slow the load runs.
WITNESS_PROMPT, WITNESS_TOKENS = [5, 6, 7, 8], 48


def _pod_env(*, group: int, store_port: int, http_port: int) -> dict:
    return {
        "DWDP_JOB": "drain", "DWDP_NAMESPACE": "test", "DWDP_GROUP": str(group), "DWDP_POD_INDEX": "0",
        "DWDP_RANK_BASE": "0", "DWDP_GPUS_PER_POD": "2", "DWDP_SIZE": "2",
        "DWDP_STORE_ADDR": "127.0.0.1", "DWDP_STORE_PORT": str(store_port), "DWDP_ATTEMPT": "0",
        "DWDP_TOKEN": f"secret-{group}", "DWDP_NUM_EXPERTS": "8", "DWDP_EXPERTS_PER_WORKER": "4",
        "DWDP_PREFETCH_STRIDE": "4", "DWDP_PREFETCH_SLOTS": "2", "DWDP_CONTENTION_OPT": "false",
        "DWDP_TRANSFER": "copy_engine", "DWDP_MODEL": "", "DWDP_MODEL_SYNTHETIC": "qwen3_moe",
        "DWDP_DTYPE": "float32", "DWDP_BACKEND": "host", "DWDP_HTTP_PORT": str(http_port),
    }


def _start_group(group: int) -> Server:
    port = free_port()
    return Server(["pod", "--host", "127.0.0.1"], port=port,
                  env=_pod_env(group=group, store_port=free_port(), http_port=port))


def test_sigterm_one_group_under_load_loses_nothing(tmp_path):
    from dwdp_worker.checkpoint.synth import write_synthetic

    ckpt = write_synthetic("qwen3_moe", tmp_path / "same", seed=0, num_experts=8, dtype="float32")
    want = {(tuple(p), n): greedy_reference(ckpt, p, n)[0] for p in PROMPTS for n in (1, 4)}
    want[(tuple(WITNESS_PROMPT), WITNESS_TOKENS)] = greedy_reference(ckpt, WITNESS_PROMPT, WITNESS_TOKENS)[0]
    stay, leave = _start_group(0), _start_group(1)
    try:
        stay.wait_for("/readyz", timeout_s=120)
        leave.wait_for("/readyz", timeout_s=120)

        results: list[tuple] = []   # (pod, outcome, detail)
        spans: list[tuple] = []     # (pod, outcome, sent, done)
        lock = threading.Lock()
        counter = iter(range(TOTAL))
        sigterm_after = TOTAL // 3
        t_start = time.monotonic()
        t_sigterm: list[float] = []
        sigterm_due = threading.Event()
        witness_span: list[tuple[str, float, float]] = []   # (outcome, sent, done)

        def post(client: httpx.Client, pod: str, prompt: list[int], n: int) -> str:
            """One request; its outcome and client-side span recorded under the lock; the outcome."""
            t_sent = time.monotonic()
            try:
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": n})
                if r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want[(tuple(prompt), n)]:
                    outcome = "answered"
                elif r.status_code == 503 and r.json()["error"]["message"]:
                    outcome = "refused_503"
                else:
                    outcome = f"bad_{r.status_code}"
                detail = r.text[:200]
            except httpx.ConnectError as exc:   # no connection was made: refused before acceptance
                outcome, detail = "refused_connect", repr(exc)
            except httpx.HTTPError as exc:      # a reset/timeout mid-request: a lost request
                outcome, detail = f"lost_{type(exc).__name__}", repr(exc)
            t_done = time.monotonic()
            with lock:
                results.append((pod, outcome, detail))
                spans.append((pod, outcome, t_sent, t_done))
                if len(results) == sigterm_after:
                    sigterm_due.set()
            return outcome

        def worker(w: int) -> None:
            # Like a Service endpoint list: after the pod refused (503 draining, or its port closed),
            # this client sends its next requests to the pod that stays.
            gone: set[str] = set()
            clients = {name: httpx.Client(base_url=srv.url, timeout=30.0)
                       for name, srv in (("stay", stay), ("leave", leave))}
            try:
                while time.monotonic() - t_start < DEADLINE_S:
                    with lock:
                        i = next(counter, None)
                    if i is None:
                        return
                    pod = "stay" if i % 2 == 0 or "leave" in gone else "leave"
                    prompt, n = PROMPTS[i % len(PROMPTS)], 1 + 3 * (i % 3 == 0)
                    if post(clients[pod], pod, prompt, n).startswith("refused"):
                        gone.add(pod)
            finally:
                for c in clients.values():
                    c.close()

        def signaller() -> None:
            # After a third of the load: stream the witness from the removed pod; its first token proves the
            # pod admitted it; SIGTERM the pod then, and read the rest of the witness's tokens.
            if not sigterm_due.wait(DEADLINE_S):
                return
            body = {"prompt": WITNESS_PROMPT, "max_tokens": WITNESS_TOKENS, "stream": True}
            ids: list[int] = []
            t_sent = time.monotonic()
            try:
                with httpx.stream("POST", f"{leave.url}/v1/completions", json=body, timeout=30.0) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ids += json.loads(line[len("data: "):])["choices"][0]["token_ids"]
                        if ids and not t_sigterm:
                            leave.signal(signal.SIGTERM)
                            t_sigterm.append(time.monotonic())
                outcome = "answered" if ids == want[(tuple(WITNESS_PROMPT), WITNESS_TOKENS)] else f"bad_{r.status_code}"
            except httpx.HTTPError as exc:  # a reset/timeout mid-stream: the admitted witness was lost
                outcome = f"lost_{type(exc).__name__}"
            if not t_sigterm:  # the witness was refused: SIGTERM anyway so the load run still ends the drain
                leave.signal(signal.SIGTERM)
                t_sigterm.append(time.monotonic())
            t_done = time.monotonic()
            with lock:
                results.append(("leave", outcome, f"witness: {len(ids)} tokens"))
                spans.append(("leave", outcome, t_sent, t_done))
                witness_span.append((outcome, t_sent, t_done))

        threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(WORKERS)]
        threads.append(threading.Thread(target=signaller, daemon=True))
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S + 35)
            assert not t.is_alive(), "a load-generator thread hung"
        elapsed = time.monotonic() - t_start
        code = leave.wait_exit(60)
        t_exit = time.monotonic()

        across = sum(1 for p, o, a, b in spans if p == "leave" and o == "answered" and a < t_sigterm[0] < b)
        by = {pod: Counter(o for p, o, _ in results if p == pod) for pod in ("stay", "leave")}
        print(f"\ndrain under load: {len(results)} requests in {elapsed:.1f} s; SIGTERM after {sigterm_after}; "
              f"staying group {dict(by['stay'])}; removed group {dict(by['leave'])}; "
              f"in flight across the SIGTERM and answered: {across}; removed pod exited {code} {t_exit - t_sigterm[0]:.1f} s after SIGTERM")
        assert len(results) == TOTAL + 1, f"{TOTAL + 1 - len(results)} requests never sent within {DEADLINE_S} s"
        assert t_sigterm, "the SIGTERM was never sent"
        bad = [(p, o, d) for p, o, d in results if p == "stay" and o != "answered"]
        assert not bad, bad[:5]
        allowed = {"answered", "refused_503", "refused_connect"}
        lost = [(p, o, d) for p, o, d in results if p == "leave" and o not in allowed]
        assert not lost, lost[:5]
        assert by["leave"]["answered"] >= sigterm_after // 2 - WORKERS  # it served before the SIGTERM
        assert by["leave"]["refused_503"] + by["leave"]["refused_connect"] > 0  # the drain was exercised
        assert across >= 1, "no request was in flight on the removed pod at the SIGTERM: the drain was not tested"
        assert witness_span, "the witness request never completed"
        w_outcome, w_sent, w_done = witness_span[0]
        assert w_outcome == "answered" and w_sent < t_sigterm[0] < w_done, (
            f"the witness, admitted before the SIGTERM, must be answered after it: {w_outcome}, "
            f"sent {w_sent - t_sigterm[0]:+.3f} s, done {w_done - t_sigterm[0]:+.3f} s from the SIGTERM")
        assert by["stay"]["answered"] > TOTAL // 2  # the staying group took over the removed group's share
        assert code == 0, leave.log()
        assert stay.get("/readyz").status_code == 200
    finally:
        stay.close()
        leave.close()
