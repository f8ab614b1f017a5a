"""No request can stall, outlive or leak the front: one real local server (1 group × 2 ranks, host backend).

* D1  a 10 MB body is a 413 before it is read, a 1.9 MB text prompt a 400 before it is tokenized, and
      ``/healthz`` keeps answering fast meanwhile; the front's memory does not grow;
* D4  a client that disconnects mid-request is cancelled: its rank stops at its next step;
* D5  a silent connection, slowloris headers and a never-finished chunked upload are closed with a JSON
      408 within their bounds; at SIGTERM an unfinished upload gets a JSON 503 at once;
* D6  no process of the server maps a named semaphore (/dev/shm/sem.*: what a SIGKILL would leave);
* D7  bodies that are not JSON (invalid UTF-8, latin-1, nesting past the parser's limit) are the
      documented 400 ``json_invalid``;
* 405 carries ``Allow``, 429 and 503 carry ``Retry-After``.

Every wait is bounded; the figures are printed with ``-s`` and recorded in RELIABILITY.md.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.timing import LOADED_SLACK_S, hold
from .serving_helpers import Server

HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 4.0
COPY_DELAY_S = 0.03   # every forward takes ≥ a few copy delays: a max_tokens loop lasts seconds
SLACK_S = LOADED_SLACK_S


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(["--local", "--model", str(model_dir), "--dwdp-size", "2", "--backend", "host",
                  "--max-queue", "2", "--header-timeout-s", str(HEADER_TIMEOUT_S),
                  "--body-timeout-s", str(BODY_TIMEOUT_S), "--served-model-name", "tiny"],
                 env={"DWDP_TEST_COPY_DELAY_S": str(COPY_DELAY_S)})
    try:
        srv.wait_for("/readyz", timeout_s=120)
        yield srv
    finally:
        srv.close()


def _probe_latencies(url: str, stop: threading.Event, out: list) -> None:
    with httpx.Client(base_url=url, timeout=30) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            c.get("/healthz")
            out.append(time.monotonic() - t0)
            time.sleep(0.01)


def _rss(server: Server) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


def test_huge_bodies_are_refused_before_work_and_probes_stay_fast(server):
    rss0 = _rss(server)
    stop, lat = threading.Event(), []
    prober = threading.Thread(target=_probe_latencies, args=(server.url, stop, lat), daemon=True)
    prober.start()
    try:
        big = json.dumps({"prompt": "the a of to and " * (10 * 2**20 // 16)}).encode()
        t0 = time.monotonic()
        r = server.post(content=big)
        t_big = time.monotonic() - t0
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
        under_cap = json.dumps({"prompt": "the a of to and " * (int(1.9 * 2**20) // 16)}).encode()
        t0 = time.monotonic()
        r = server.post(content=under_cap)
        t_text = time.monotonic() - t0
        assert r.status_code == 400 and "cannot fit" in r.json()["error"]["message"], r.text
        for _ in range(3):  # the same, several times: nothing accumulates
            assert server.post(content=under_cap).status_code == 400
    finally:
        stop.set()
        prober.join(10)
    grew = (_rss(server) - rss0) / 2**20
    print(f"\n10 MB body → 413 in {t_big * 1000:.0f} ms; 1.9 MB text → 400 in {t_text * 1000:.0f} ms; "
          f"/healthz meanwhile: {len(lat)} probes, max {max(lat) * 1000:.0f} ms; front RSS +{grew:.1f} MiB")
    assert lat and max(lat) < 1.0, lat
    assert grew < 64, grew


def _wait_idle(server: Server, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = server.get("/readyz").json()
        if body["inflight"] == 0 and not any(r["busy"] for r in body["ranks"]):
            return body
        time.sleep(0.02)
    raise AssertionError(f"the server was still busy {timeout_s} s after the client left: {body}")


def test_a_client_that_disconnects_is_cancelled_at_the_next_step(server):
    before = server.get("/readyz").json()
    with httpx.Client(base_url=server.url, timeout=1.0) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": [3, 1, 4], "max_tokens": 60})
    t_gone = time.monotonic()
    after = _wait_idle(server, 10)
    cancel_s = time.monotonic() - t_gone
    forwards = after["forwards"] - before["forwards"]
    print(f"\nclient gone after 1 s: rank idle {cancel_s * 1000:.0f} ms later; forwards run {forwards} of 60")
    assert after["cancelled"] == before["cancelled"] + 1
    assert forwards < 60, forwards
    hold(0.5, "a window in which nothing may run for the gone client")
    assert server.get("/readyz").json()["forwards"] == after["forwards"]  # nothing runs for it any more


def _read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    sock.settimeout(limit_s)
    t0, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {limit_s} s (got {data[:200]!r})") from None
    except ConnectionResetError:
        pass
    return data, time.monotonic() - t0


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def test_silent_slow_and_unfinished_clients_are_closed_within_bounds(server):
    def silent():
        with _connect(server) as s:
            return _read_until_closed(s, HEADER_TIMEOUT_S + SLACK_S)

    def slowloris():
        with _connect(server) as s:
            t0 = time.monotonic()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
            for i in range(int((HEADER_TIMEOUT_S + SLACK_S) / 0.25)):
                s.sendall(f"x-slow-{i}: 1\r\n".encode())  # a header line every 0.25 s, never the end
                if select.select([s], [], [], 0.25)[0]:
                    break  # the server answered: stop writing (a write after its close would reset)
            data, _ = _read_until_closed(s, SLACK_S)
            return data, time.monotonic() - t0

    def unfinished_chunked():
        with _connect(server) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"transfer-encoding: chunked\r\n\r\n5\r\n{\"pro\r\n")
            return _read_until_closed(s, BODY_TIMEOUT_S + SLACK_S)

    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(f) for f in (silent, slowloris, unfinished_chunked)]
        (d_silent, t_silent), (d_slow, t_slow), (d_body, t_body) = [f.result() for f in runs]
    print(f"\nclosed: silent connection {t_silent:.1f} s, slowloris {t_slow:.1f} s (header bound "
          f"{HEADER_TIMEOUT_S:g} s); unfinished chunked upload {t_body:.1f} s (body bound {BODY_TIMEOUT_S:g} s)")
    for data, took, bound, code in ((d_silent, t_silent, HEADER_TIMEOUT_S, "header_timeout"),
                                    (d_slow, t_slow, HEADER_TIMEOUT_S, "header_timeout"),
                                    (d_body, t_body, BODY_TIMEOUT_S, "body_timeout")):
        assert data.startswith(b"HTTP/1.1 408"), data[:300]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == code, data
        assert bound - 0.5 < took < bound + SLACK_S, (code, took)
    assert server.get("/healthz").status_code == 200


NOT_JSON = [("invalid UTF-8", b'{"prompt": "\xff\xfe"}'), ("latin-1", '{"prompt": "café"}'.encode("latin-1")),
            ("deep nesting", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
            ("deep nesting of a list", b"[" * 100_000 + b"]" * 100_000)]


@pytest.mark.parametrize("name,body", NOT_JSON, ids=[n for n, _ in NOT_JSON])
def test_bodies_that_are_not_json_get_the_documented_json_invalid(server, name, body):
    for ctype in ("application/json", "application/json; charset=latin-1"):
        r = server.post(content=body, headers={"content-type": ctype})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "json_invalid" and err["message"].startswith("the request body is not valid JSON"), err


def test_no_process_of_the_server_holds_a_named_semaphore(server):
    procs = [psutil.Process(server.proc.pid)] + [psutil.Process(pid) for pid in server.rank_pids()]
    for p in procs:
        with open(f"/proc/{p.pid}/maps") as f:
            sems = [line.split()[-1] for line in f if "/dev/shm/sem." in line]
        assert not sems, f"pid {p.pid} ({p.name()}) maps {sems}: a SIGKILL would leave them in /dev/shm"


def test_405_names_allowed_methods_and_429_says_when_to_retry(server):
    r = server.http.delete("/healthz")
    assert r.status_code == 405 and r.headers["allow"] == "GET" and r.json()["error"]["message"], r.text
    # 2 ranks busy + a queue of 2: a burst of 8 long requests must meet a full queue
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(server.post, [{"prompt": [5, i], "max_tokens": 20} for i in range(8)]))
    full = [r for r in results if r.status_code == 429]
    assert full and all(r.headers.get("retry-after", "").isdigit() for r in full), [r.status_code for r in results]
    assert {r.status_code for r in results} <= {200, 429}


def test_sigterm_answers_an_unfinished_upload_with_json_503_at_once(server):
    long_request: dict = {}

    def run():
        long_request["r"] = server.post({"prompt": [2, 7], "max_tokens": 10})

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while server.get("/readyz").json()["inflight"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    upload = _connect(server)
    upload.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: 1000\r\n\r\n{\"prompt\": [1,")
    hold(0.2, "the server reads the upload's head")
    server.signal()
    t_term = time.monotonic()
    r = server.post({"prompt": [1]})  # while draining: refused, with when to retry
    assert r.status_code == 503 and r.headers.get("retry-after", "").isdigit(), r.text
    data, _ = _read_until_closed(upload, 15)
    t_upload = time.monotonic() - t_term
    upload.close()
    t.join(30)
    assert long_request["r"].status_code == 200  # the admitted request finished
    code = server.wait_exit(30)
    t_exit = time.monotonic() - t_term
    print(f"\nSIGTERM: unfinished upload answered {t_upload:.2f} s later; exit {code} after {t_exit:.1f} s")
    assert data.startswith(b"HTTP/1.1 503"), data[:300]
    head, body = data.split(b"\r\n\r\n", 1)
    assert b"application/json" in head and b"stopping" in body, data
    assert t_upload < BODY_TIMEOUT_S, t_upload  # cut by the shutdown, not by the body timeout
    assert code == 0, server.log()
