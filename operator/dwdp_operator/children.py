"""The kinds of child object a DwdpGroup owns, in one table: API path, and the fix a user needs when
the API server does not serve the kind.

Adding a child kind (an InferencePool, a KV-transfer Service, ...) is: a pure builder in
``manifests.py``, a row in ``KINDS``, and the RBAC verb in the chart. Custom resources need no code
here: every kind goes through ``rest.RawApi`` by ``apiVersion`` and ``plural``.

Invariant: a create's or delete's answer is never parsed (``rest.RawApi``: no client models; the 1.20
server also answers some deletes with a Status that the typed client cannot parse).
"""

from __future__ import annotations

from dataclasses import dataclass

from .manifests import CD_API_VERSION, IP_API_VERSION
from .rest import RawApi

NO_INFERENCE_POOL_CRD_FIX = ("install the Gateway API Inference Extension CRDs (InferencePool "
                             "inference.networking.k8s.io/v1) or remove spec.inferencePool")
NO_DRA_DRIVER_FIX = "install the NVIDIA DRA driver for GPUs (ComputeDomain CRD) or set imex.mode: None"


@dataclass(frozen=True)
class ChildKind:
    kind: str
    api_version: str      # "v1", "networking.k8s.io/v1", or a custom resource's group/version
    plural: str
    not_served_fix: str = ""  # what to do when the API server answers 404 for the kind itself

    def fix_when_not_served(self) -> str:
        return self.not_served_fix or f"install the CRD that serves {self.api_version} {self.kind}"

    def create(self, api: RawApi, ns: str, body: dict) -> None:
        api.create(self.api_version, ns, self.plural, body)

    def delete(self, api: RawApi, ns: str, name: str, *, grace_seconds: int | None = None) -> None:
        api.delete(self.api_version, ns, self.plural, name, grace_seconds=grace_seconds)


KINDS: dict[str, ChildKind] = {k.kind: k for k in (
    ChildKind("Secret", "v1", "secrets"),
    ChildKind("Service", "v1", "services"),
    ChildKind("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies"),
    ChildKind("ComputeDomain", CD_API_VERSION, "computedomains", NO_DRA_DRIVER_FIX),
    ChildKind("InferencePool", IP_API_VERSION, "inferencepools", NO_INFERENCE_POOL_CRD_FIX),
    ChildKind("Pod", "v1", "pods"),
)}
