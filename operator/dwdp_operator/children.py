"""The kinds of child object a DwdpGroup owns, in one table: API path, and the fix a user needs when
the API server does not serve the kind.

Adding a child kind (an InferencePool, a KV-transfer Service, ...) is: a pure builder in
``manifests.py``, a row in ``KINDS``, and the RBAC verb in the chart. Custom resources need no code
here: they go through ``CustomObjectsApi`` by ``apiVersion`` and ``plural``.

Invariant: every write uses ``_preload_content=False`` — the operator never reads a create's answer,
and skipping the client's model deserialization is most of a create's CPU cost (the 1.20 server
also answers some deletes with a Status that the typed client cannot parse).
"""

from __future__ import annotations

from dataclasses import dataclass

from kubernetes import client

from .manifests import CD_API_VERSION, IP_API_VERSION

NO_INFERENCE_POOL_CRD_FIX = ("install the Gateway API Inference Extension CRDs (InferencePool "
                             "inference.networking.k8s.io/v1) or remove spec.inferencePool")
NO_DRA_DRIVER_FIX = "install the NVIDIA DRA driver for GPUs (ComputeDomain CRD) or set imex.mode: None"


@dataclass(frozen=True)
class ChildKind:
    kind: str
    api_version: str      # "v1", "networking.k8s.io/v1", or a custom resource's group/version
    plural: str
    not_served_fix: str = ""  # what to do when the API server answers 404 for the kind itself

    @property
    def custom(self) -> bool:
        return self.api_version not in ("v1", "networking.k8s.io/v1")

    def fix_when_not_served(self) -> str:
        return self.not_served_fix or f"install the CRD that serves {self.api_version} {self.kind}"

    def create(self, api: client.ApiClient, ns: str, body: dict) -> None:
        self._call(api, "create", ns, body)

    def delete(self, api: client.ApiClient, ns: str, name: str) -> None:
        self._call(api, "delete", ns, name)

    def _call(self, api: client.ApiClient, verb: str, ns: str, arg) -> None:
        if self.custom:
            group, version = self.api_version.split("/")
            fn = getattr(client.CustomObjectsApi(api), f"{verb}_namespaced_custom_object")
            _release(fn(group, version, ns, self.plural, arg, _preload_content=False))
            return
        typed = client.NetworkingV1Api(api) if self.kind == "NetworkPolicy" else client.CoreV1Api(api)
        fn = getattr(typed, f"{verb}_namespaced_{_snake(self.kind)}")
        args = (ns, arg) if verb == "create" else (arg, ns)  # the typed client: create(ns, body), delete(name, ns)
        _release(fn(*args, _preload_content=False))


def _release(response) -> None:
    """Read the unparsed answer so its connection goes back to the pool (urllib3 keeps it otherwise)."""
    read = getattr(response, "read", None)
    if read is not None:
        read()
    release = getattr(response, "release_conn", None)
    if release is not None:
        release()


def _snake(kind: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(kind))


KINDS: dict[str, ChildKind] = {k.kind: k for k in (
    ChildKind("Secret", "v1", "secrets"),
    ChildKind("Service", "v1", "services"),
    ChildKind("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies"),
    ChildKind("ComputeDomain", CD_API_VERSION, "computedomains", NO_DRA_DRIVER_FIX),
    ChildKind("InferencePool", IP_API_VERSION, "inferencepools", NO_INFERENCE_POOL_CRD_FIX),
    ChildKind("Pod", "v1", "pods"),
)}
