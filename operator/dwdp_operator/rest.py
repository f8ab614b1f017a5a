"""The operator's write path to the API server: plain JSON dicts out, parsed JSON back only when asked.

Why not the generated ``kubernetes`` client methods for writes: each call validates its arguments
(pydantic ``validate_call``), walks the body through ``sanitize_for_serialization`` and builds its
request through the generic parameter machinery. Measured on the test control plane (one thread,
200 pod creates): 0.9–1.2 ms of client CPU per create through ``CoreV1Api``/``CustomObjectsApi``,
0.4 ms for the same request sent here. The operator shares 2 cores with kube-apiserver and etcd
(``bench/operator_scale.py``), so client CPU is API-server throughput.

Invariants:
  1. One connection pool, TLS setup, proxy and auth with the ``ApiClient`` it wraps: requests go
     through ``api.rest_client``, and the bearer token comes from the client's configuration
     (``auth_settings()``, which runs the token refresh hook of in-cluster and exec credentials),
     read again at least every ``AUTH_REFRESH_S``. Not per request: a kubeconfig's hook re-applies
     the whole configuration, and setting its host re-reads every proxy variable of the
     environment — measured as 18 % of the operator's CPU at 500 DwdpGroups (thread-time cProfile).
  2. A non-2xx answer raises the client's own ``ApiException`` (``from_response``), so
     ``refusals.classify``/``describe`` read it exactly as before.
  3. Every answer is read to the end (the connection returns to the pool) and is parsed only when
     the caller asks for the body (``want_body``); nothing is turned into client model objects.
  4. Every request has a connect and a read limit (``REQUEST_TIMEOUT``): a silent server fails the
     pass (the reconciler retries it) instead of holding it forever.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable

from kubernetes import client
from kubernetes.client.rest import ApiException

AUTH_REFRESH_S = 1.0  # tokens live minutes (in-cluster: re-read every minute); a second of reuse is nothing
#: seconds to open a connection: the API server is a local Service; longer means it is away
CONNECT_TIMEOUT_S = 5.0
#: seconds to wait for an answer's next bytes. Without a limit a request on a half-open connection (a server
#: SIGKILLed or partitioned whose FIN never arrived, a request accepted during a restart and never answered)
#: waits forever, and with it the one reconcile pass of its DwdpGroup: nothing reconciles that group again
#: (invariant 4). Writes and gets answer in milliseconds; kube-apiserver's own limit is 60 s (--request-timeout)
READ_TIMEOUT_S = 30.0
REQUEST_TIMEOUT = (CONNECT_TIMEOUT_S, READ_TIMEOUT_S)
MERGE_PATCH = "application/merge-patch+json"
JSON = "application/json"


def collection_path(api_version: str, ns: str, plural: str) -> str:
    """``/api/v1/namespaces/<ns>/<plural>`` for the core group, ``/apis/<group>/<version>/...`` otherwise."""
    root = "/api/" if api_version == "v1" else "/apis/"
    return f"{root}{api_version}/namespaces/{ns}/{plural}"


class RawApi:
    def __init__(self, api: client.ApiClient, *, clock: Callable[[], float] = time.monotonic):
        self.api, self.clock = api, clock
        self.base = api.configuration.host
        self._auth: tuple[float, dict[str, str]] = (float("-inf"), {})
        self._auth_lock = threading.Lock()

    def _auth_headers(self) -> dict[str, str]:
        now = self.clock()
        with self._auth_lock:
            if now - self._auth[0] >= AUTH_REFRESH_S:
                auth = self.api.configuration.auth_settings().get("BearerToken")
                self._auth = (now, {auth["key"]: auth["value"]} if auth and auth.get("value") else {})
            return self._auth[1]

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = JSON,
                want_body: bool = False) -> dict | None:
        headers = {"Accept": JSON, "Content-Type": content_type, "User-Agent": self.api.user_agent,
                   **self._auth_headers()}
        resp = self.api.rest_client.request(method, self.base + path, headers=headers, body=body,
                                            _request_timeout=REQUEST_TIMEOUT)
        data = resp.read()  # invariant 3: always drained
        if not 200 <= resp.status <= 299:
            raise ApiException.from_response(http_resp=resp, body=None, data=None)
        return json.loads(data) if want_body and data else None

    def create(self, api_version: str, ns: str, plural: str, body: dict) -> None:
        self.request("POST", collection_path(api_version, ns, plural), body)

    def delete(self, api_version: str, ns: str, plural: str, name: str, *, grace_seconds: int | None = None) -> None:
        body = None if grace_seconds is None else {"gracePeriodSeconds": grace_seconds}
        self.request("DELETE", f"{collection_path(api_version, ns, plural)}/{name}", body)

    def get(self, api_version: str, ns: str, plural: str, name: str) -> dict:
        return self.request("GET", f"{collection_path(api_version, ns, plural)}/{name}", want_body=True) or {}

    def merge_patch(self, api_version: str, ns: str, plural: str, name: str, patch: dict, *,
                    subresource: str = "", want_body: bool = False) -> dict | None:
        path = f"{collection_path(api_version, ns, plural)}/{name}" + (f"/{subresource}" if subresource else "")
        return self.request("PATCH", path, patch, content_type=MERGE_PATCH, want_body=want_body)
