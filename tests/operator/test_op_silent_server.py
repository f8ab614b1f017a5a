"""The operator never waits forever on the API server (rest invariant 4, pod_informer invariant 5).

A real HTTP server on 127.0.0.1 that accepts requests and then says nothing — what a client sees on a
half-open connection (a server SIGKILLed or partitioned whose FIN never arrived). The limits are shortened
for the test by setting the modules' named constants; the requests, sockets and threads are real.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client

from dwdp_operator import pod_informer, rest


class _SilentApi:
    """Answers a pod list (``silent_lists``: the first N lists hang instead), and hangs every watch after
    sending its headers, until ``close``."""

    def __init__(self, *, silent_lists: int = 0):
        self.lists = 0
        self.watches = 0
        self.silent_lists = silent_lists
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802
                if "watch=true" in self.path:
                    outer.watches += 1
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.flush()
                    outer.release.wait(30)
                    return
                outer.lists += 1
                if outer.lists <= outer.silent_lists:
                    outer.release.wait(30)
                    return
                body = json.dumps({"kind": "PodList", "items": [], "metadata": {"resourceVersion": "7"}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PATCH(self):  # noqa: N802
                outer.release.wait(30)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def api(self) -> client.ApiClient:
        cfg = client.Configuration()
        cfg.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        return client.ApiClient(cfg)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def silent(request):
    srv = _SilentApi(**getattr(request, "param", {}))
    yield srv
    srv.close()


def test_a_write_to_a_silent_server_fails_instead_of_holding_the_pass(silent, monkeypatch):
    monkeypatch.setattr(rest, "REQUEST_TIMEOUT", (1.0, 0.5))
    api = rest.RawApi(silent.api)
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        api.merge_patch("dwdp.io/v1alpha1", "ns", "dwdpgroups", "g", {"status": {}}, subresource="status")
    assert time.monotonic() - t0 < 10, "the patch waited past its read limit"
    assert "timed out" in str(err.value).lower() or "timeout" in type(err.value).__name__.lower(), err.value


@pytest.mark.parametrize("silent", [{"silent_lists": 1}], indirect=True)
def test_the_pod_informer_relists_after_a_silent_list_and_a_silent_watch(silent, monkeypatch):
    monkeypatch.setattr(pod_informer, "REQUEST_TIMEOUT", (1.0, 0.5))
    monkeypatch.setattr(pod_informer, "WATCH_TIMEOUT_S", 1)
    monkeypatch.setattr(pod_informer, "WATCH_GRACE_S", 1)
    monkeypatch.setattr(pod_informer, "RELIST_BACKOFF_S", 0.05)
    inf = pod_informer.PodInformer(silent.api, namespaces=["ns"], match=lambda ns: True,
                                   on_change=lambda key: None).start()
    try:
        deadline = time.monotonic() + 20
        # the first list hangs (read limit), the second answers, its watch hangs (read limit), a third list
        while time.monotonic() < deadline and silent.lists < 3:
            time.sleep(0.05)
        assert silent.lists >= 3 and silent.watches >= 1, (silent.lists, silent.watches)
        assert inf.pods_of(("ns", "g")) == []  # the answered list is in: no pods, not "unknown"
    finally:
        inf.stop()
