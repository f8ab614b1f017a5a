"""served.py against the real API server: discovery read as kopf reads it, and the wait kopf's starts sit behind.

The wait must end as soon as discovery lists a resource that appears while it waits (a CRD created mid-wait, as
after a server restart discovery catches up), and end with a message naming the resource when it never appears.
The restart itself is covered by test_k8s_faults.py (test_apiserver_restart_mid_reconcile,
test_operator_started_during_an_apiserver_restart).
"""

from __future__ import annotations

import threading
import time

import pytest
from kubernetes import client

from dwdp_operator import served

TEST_GROUP = "served-test.dwdp.io"


def _crd(plural: str) -> dict:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{TEST_GROUP}"},
            "spec": {"group": TEST_GROUP, "scope": "Cluster",
                     "names": {"plural": plural, "singular": plural[:-1], "kind": plural[:-1].capitalize()},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {"type": "object",
                                                                  "x-kubernetes-preserve-unknown-fields": True}}}]}}


def test_discovery_lists_dwdpgroups_and_names_what_is_missing(cluster):
    assert served.read_discovery(cluster.api) == served.Discovery(True, "listed")
    no_plural = served.read_discovery(cluster.api, served.Resource("dwdp.io", "v1alpha1", "nosuchthings"))
    assert not no_plural.listed and "dwdpgroups" in no_plural.detail and "nosuchthings" in no_plural.detail
    no_group = served.read_discovery(cluster.api, served.Resource("nosuch.dwdp.io", "v1", "things"))
    assert not no_group.listed and "nosuch.dwdp.io" in no_group.detail


def test_the_wait_ends_when_a_crd_appears_and_names_one_that_never_does(cluster):
    ext = client.ApiextensionsV1Api(cluster.api)
    plural = "waitthings"
    late = served.Resource(TEST_GROUP, "v1", plural)
    creator = threading.Timer(1.0, lambda: ext.create_custom_resource_definition(_crd(plural)))
    try:
        creator.start()
        t0 = time.monotonic()
        waited = served.wait_until_served(cluster.api, late, wait_s=30, poll_s=0.1)
        assert 1.0 <= waited <= time.monotonic() - t0 < 30
        with pytest.raises(served.NotServed, match=f"nevers.{TEST_GROUP}/v1 is not served") as e:
            served.wait_until_served(cluster.api, served.Resource(TEST_GROUP, "v1", "nevers"), wait_s=1.0,
                                     poll_s=0.1)
        assert plural in str(e.value), "the message says what the group does serve"
    finally:
        creator.cancel()
        try:
            ext.delete_custom_resource_definition(f"{plural}.{TEST_GROUP}")
        except client.ApiException:
            pass
