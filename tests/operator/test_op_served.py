"""served.py without an API server: a refused connection is a "not listed" read, never an exception, and the
wait ends with a message that names the resource and how to install its CRD. (Against the real server:
tests/k8s/test_k8s_served.py.)"""

import time

import pytest
from kubernetes import client

from dwdp_operator import served
from dwdp_runtime.ports import free_port
from tests.timing import LOADED_SLACK_S


@pytest.fixture
def refused_client():
    """A client for a local port that nothing listens on (the kernel refuses the connection)."""
    port = free_port()
    cfg = client.Configuration(host=f"https://127.0.0.1:{port}")
    cfg.retries = False
    return client.ApiClient(cfg)


def test_a_refused_connection_is_a_read_that_did_not_list(refused_client):
    seen = served.read_discovery(refused_client)
    assert not seen.listed and seen.detail.startswith("discovery failed:")


def test_the_wait_gives_up_with_the_resource_and_the_install_hint(refused_client):
    t0 = time.monotonic()
    with pytest.raises(served.NotServed, match=r"dwdpgroups\.dwdp\.io/v1alpha1 is not served: discovery failed") as e:
        served.wait_until_served(refused_client, wait_s=0.5, poll_s=0.05)
    assert 0.5 <= time.monotonic() - t0 < 0.5 + LOADED_SLACK_S
    assert "kubectl apply -f crds/dwdpgroup.yaml" in str(e.value) and e.value.status == 404
