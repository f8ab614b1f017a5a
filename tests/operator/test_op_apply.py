"""apply.py's error semantics without a server: only AlreadyExists counts as "created"."""

import json

import pytest
from kubernetes.client.rest import ApiException

from dwdp_operator.apply import Applier


class _Core:
    def __init__(self, exc):
        self.exc, self.calls = exc, 0

    def create_namespaced_service(self, ns, body):
        self.calls += 1
        if self.exc:
            raise self.exc


def _exc(status, reason=None):
    e = ApiException(status=status, reason="x")
    e.body = json.dumps({"kind": "Status", "code": status, "reason": reason}) if reason else None
    return e


SVC = {"kind": "Service", "metadata": {"name": "s", "labels": {}}}


def test_already_exists_is_success_and_remembered():
    a = Applier()
    a.core = _Core(_exc(409, "AlreadyExists"))
    assert a._create("ns", SVC, "u") == 0
    assert a._remembered("ns", SVC, "u")


@pytest.mark.parametrize("exc", [_exc(409, "Conflict"), _exc(409), _exc(500), _exc(429, "TooManyRequests")])
def test_other_errors_fail_the_pass_and_are_not_remembered(exc):
    a = Applier()
    a.core = _Core(exc)
    with pytest.raises(ApiException):
        a._create("ns", SVC, "u")
    assert not a._remembered("ns", SVC, "u"), "a failed create must be retried, not remembered"
