"""Fault injection for the operator subprocess (tests only): on ``PYTHONPATH`` with
``DWDP_TEST_FAULTS=<seed>:<rate>[:<log path>]``, every write the operator's kubernetes client sends
(POST, PATCH, PUT, DELETE) fails, with probability ``rate``, *before* it reaches the server, as
409 Conflict, 500 Internal Error or 429 Too Many Requests (seeded choice). Reads and kopf's own
aiohttp client are untouched. One line per injected fault is appended to the log path, so tests
report how many faults they survived.

Invariant: with the variable unset, this module changes nothing.
"""

import os

_spec = os.environ.get("DWDP_TEST_FAULTS")
if _spec:
    import random
    import threading

    from kubernetes.client import rest

    _seed, _rate, *_log = _spec.split(":", 2)
    _rng, _lock = random.Random(int(_seed)), threading.Lock()
    _orig = rest.RESTClientObject.request
    _FAULTS = ((409, "Conflict"), (500, "Internal Server Error"), (429, "Too Many Requests"))

    def _request(self, method, url, *args, **kwargs):
        if method in ("POST", "PATCH", "PUT", "DELETE"):
            with _lock:
                fault = _rng.choice(_FAULTS) if _rng.random() < float(_rate) else None
            if fault:
                if _log:
                    with open(_log[0], "a") as f:
                        f.write(f"{fault[0]} {method} {url.split('?')[0]}\n")
                raise rest.ApiException(status=fault[0], reason=f"{fault[1]} (injected)")
        return _orig(self, method, url, *args, **kwargs)

    rest.RESTClientObject.request = _request
