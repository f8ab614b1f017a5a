"""Helpers for the serving tests: real `dwdp-worker` processes on free loopback ports.

``Server`` runs ``python -m dwdp_worker.launch.cli …`` with this checkout first on ``PYTHONPATH``, waits
(bounded) for a probe, and always kills what it started. Nothing here fakes the engine.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _p in (ROOT / "worker", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


def free_port() -> int:
    """A local port free now, outside the kernel's ephemeral ports (``dwdp_runtime.ports``)."""
    from dwdp_runtime.ports import free_port as draw

    return draw()


def child_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DWDP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "worker"), str(ROOT)] +
                                        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


class Server:
    def __init__(self, args: list[str], *, env: dict | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="dwdp-test-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "dwdp_worker.launch.cli", *args]
        if "pod" not in args[:1]:
            cmd += ["--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=child_env(env), stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=str(ROOT))
        self.http = httpx.Client(base_url=self.url, timeout=60.0)

    def log(self) -> str:
        return pathlib.Path(self._log.name).read_text(errors="replace")

    def get(self, path: str) -> httpx.Response:
        return self.http.get(path)

    def post(self, body=None, *, content=None, headers=None) -> httpx.Response:
        if content is not None:
            return self.http.post("/v1/completions", content=content,
                                  headers=headers or {"content-type": "application/json"})
        return self.http.post("/v1/completions", json=body)

    def wait_for(self, path: str = "/readyz", *, status: int = 200, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} while waiting for {path}:\n{self.log()}")
            try:
                r = self.get(path)
                last = (r.status_code, r.text[:500])
                if r.status_code == status:
                    return r.json()
            except httpx.TransportError as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise AssertionError(f"{path} never answered {status} within {timeout_s} s (last: {last}):\n{self.log()}")

    def rank_pids(self) -> list[int]:
        return [r["pid"] for r in self.get("/readyz").json()["ranks"]]

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server did not exit within {timeout_s} s:\n{self.log()}") from None

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.unlink(self._log.name)
        except OSError:
            pass


def greedy_reference(model_dir, tokens: list[int], steps: int):
    """(token ids, their logprobs, top-5 logprobs per step) from the unsharded transformers model."""
    import torch

    from dwdp_worker.launch.oracle import Reference

    ref = Reference(model_dir)
    seq, ids, lps, tops = list(tokens), [], [], []
    for _ in range(steps):
        logits = ref.logits([seq])[0]
        logp = torch.log_softmax(logits.float(), -1)
        t = int(torch.argmax(logits))
        v, i = torch.topk(logp, 5)
        ids.append(t)
        lps.append(float(logp[t]))
        tops.append(list(zip(i.tolist(), v.tolist())))
        seq.append(t)
    return ids, lps, tops


def pod_env(*, job: str, pod_index: int, store_port: int, http_port: int, group: int = 0, gpus_per_pod: int = 1,
            attempt: int = 0, token: str = "the-group-secret", backend: str = "host", extra: dict | None = None) -> dict:
    """The operator's pod environment (docs/ENV_CONTRACT.md) for a synthetic qwen3_moe group of 2 ranks."""
    env = {
        "DWDP_JOB": job, "DWDP_NAMESPACE": "test", "DWDP_GROUP": str(group), "DWDP_POD_INDEX": str(pod_index),
        "DWDP_RANK_BASE": str(pod_index * gpus_per_pod), "DWDP_GPUS_PER_POD": str(gpus_per_pod), "DWDP_SIZE": "2",
        "DWDP_STORE_ADDR": "127.0.0.1", "DWDP_STORE_PORT": str(store_port), "DWDP_ATTEMPT": str(attempt),
        "DWDP_TOKEN": token, "DWDP_NUM_EXPERTS": "8", "DWDP_EXPERTS_PER_WORKER": "4",
        "DWDP_PREFETCH_STRIDE": "4", "DWDP_PREFETCH_SLOTS": "2", "DWDP_CONTENTION_OPT": "false",
        "DWDP_TRANSFER": "copy_engine", "DWDP_MODEL": "", "DWDP_MODEL_SYNTHETIC": "qwen3_moe",
        "DWDP_DTYPE": "float32", "DWDP_BACKEND": backend, "DWDP_HTTP_PORT": str(http_port),
    }
    env.update(extra or {})
    return env


def local_group(model_dir, *extra: str, ready_timeout_s: float = 120.0):
    """A module fixture's body: one local group (1 × 2 ranks, host backend) serving ``model_dir`` as
    "tiny", ready; always closed. Use as ``yield from local_group(model_dir, "--max-num-tokens", "48")``."""
    srv = Server(["--local", "--model", str(model_dir), "--groups", "1", "--dwdp-size", "2", "--backend", "host",
                  "--served-model-name", "tiny", *extra])
    try:
        srv.wait_for("/readyz", timeout_s=ready_timeout_s)
        yield srv
    finally:
        srv.close()
