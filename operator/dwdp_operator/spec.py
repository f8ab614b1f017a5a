"""The DwdpGroup spec as a pydantic model, and ``validate_spec``: every rule the operator enforces.

Invariants:
  1. Field names, types, bounds and defaults mirror ``crds/dwdpgroup.yaml`` (a unit test compares
     the CRD's defaults with this model's).
  2. The expert-sharding rules are NOT written here: ``dwdp_runtime.config.sharding_errors`` is the
     one implementation, shared with the runtime's ``DwdpConfig``.
  3. ``validate_spec`` never raises on user input; it returns human messages (``[]`` = valid).
  4. More checks plug in with ``@register_check``: a function ``(DwdpGroupSpec) -> list[str]``
     (``sizing.py`` registers the planner's memory-fit check; the package ``__init__`` imports it,
     so this module imports nothing of the operator). Checks run in registration order, only on
     specs that parsed.
  5. Messages name the user's own fields, camelCase as written in the DwdpGroup (``spec.dwdpSize``),
     never the runtime's snake_case parameters (``SPEC_NAMES`` translates the shared rules' words).
  6. Every cross-field rule here that a CEL expression can state is also in the CRD's
     ``x-kubernetes-validations`` (servers >= 1.25 refuse the object at admission);
     ``tests/operator/test_op_crd.py`` holds the two to each other with a property test.
     Operator-only: reserved ``template.env`` names and the planner's memory fit.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dwdp_runtime.config import sharding_errors
from dwdp_runtime.contract import (DEFAULT_HTTP_PORT, DEFAULT_MAX_NEW_TOKENS, DEFAULT_STORE_PORT, DEFAULT_TRANSFER, KV_TCP_PORTS, LABEL_PREFIX,
                                   MAX_CUDA_GRAPHS, POD_ENV,
                                   RESERVED_POD_ENV, ModelDtype, ModelDtypeName, TransferMode)

GROUP = LABEL_PREFIX
# docs/ENV_CONTRACT.md: the variables the operator sets on every worker pod (manifests.worker_env)
CONTRACT_ENV: tuple[str, ...] = tuple(v.value for v in POD_ENV)
VERSION = "v1alpha1"
PLURAL = "dwdpgroups"
KIND = "DwdpGroup"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class Experts(_Model):
    numExperts: int = Field(ge=1)
    numExpertsPerWorker: int = Field(ge=1)
    numPrefetchExperts: int = Field(ge=1)
    numPrefetchSlots: int = Field(default=2, ge=2)
    contentionOpt: bool = False
    transfer: TransferMode = DEFAULT_TRANSFER


class Model(_Model):
    path: str | None = Field(default=None, min_length=1)
    synthetic: Literal["qwen3_moe", "mixtral", "deepseek_v3"] | None = None
    dtype: ModelDtypeName = ModelDtype.BFLOAT16.value


class Sizing(_Model):
    """Planner inputs (optional): a model preset or config.json path and a hardware preset."""

    model: str = Field(min_length=1)
    hardware: str = Field(default="h200-hgx", min_length=1)
    weightDtype: Literal["bf16", "fp8", "nvfp4"] = "bf16"
    isl: int = Field(default=8192, ge=1)
    minKvGiB: float = Field(default=0.0, ge=0)


class Imex(_Model):
    mode: Literal["ComputeDomain", "None"] = "ComputeDomain"


class RestartPolicy(_Model):
    maxRestarts: int = Field(default=5, ge=0)
    backoffSeconds: int = Field(default=10, ge=0, le=3600)
    # a group split between bound pods and a pod the scheduler cannot place (e.g. its first pod chose
    # a clique that lost a node) is a dead end: restart it away from those nodes after this long; 0 = never
    unschedulableSeconds: int = Field(default=300, ge=0, le=86400)


class Rollout(_Model):
    maxUnavailableGroups: int = Field(default=1, ge=1)


class KvTransfer(_Model):
    """KV handoff to decode engines over NIXL (docs/KV_TRANSFER.md): each rank keeps requested KV in a
    region of ``budgetBytes`` (GPU memory), freed when pulled or after ``ttlSeconds``."""

    budgetBytes: int = Field(ge=0)
    blockBytes: int = Field(default=1 << 20, ge=64, multiple_of=64)
    ttlSeconds: float = Field(default=30.0, gt=0)
    leaseSeconds: float = Field(default=30.0, gt=0)
    # UCX's TCP listeners use [tcpPortBase, tcpPortBase + KV_TCP_PORTS) (the NetworkPolicy opens it)
    tcpPortBase: int = Field(default=30000, ge=1024, le=65536 - KV_TCP_PORTS)


class Serving(_Model):
    """The workers' HTTP front (``contract.ServingEnv``); absent = the worker's defaults."""

    maxQueue: int = Field(default=256, ge=1, le=1_000_000)
    maxNumTokens: int = Field(default=8192, ge=1, le=10_000_000)
    maxNumSeqs: int = Field(default=256, ge=1, le=65536)
    maxNewTokens: int = Field(default=DEFAULT_MAX_NEW_TOKENS, ge=1, le=1_000_000)
    servedModelName: str | None = Field(default=None, min_length=1)
    #: prefill batch shapes per rank replayed from CUDA graphs (each keeps its activations' memory); 0 = off
    cudaGraphs: int = Field(default=0, ge=0, le=MAX_CUDA_GRAPHS)


class EndpointPicker(_Model):
    """The Gateway API Inference Extension's endpoint picker (EPP) Service that routes to the pool."""

    name: str = Field(min_length=1)
    port: int = Field(default=9002, ge=1, le=65535)   # the EPP's gRPC ext-proc port (its default)
    failureMode: Literal["FailOpen", "FailClose"] = "FailClose"


class InferencePool(_Model):
    """Ask for an ``InferencePool`` (inference.networking.k8s.io/v1) over this DwdpGroup's serving pods."""

    endpointPicker: EndpointPicker


class Autoscaling(_Model):
    """Prefill-aware autoscaling of numGroups (docs/OPERATOR.md, "Autoscaling"); cross-field rules:
    ``autoscale.autoscaling_errors`` (registered check)."""

    minGroups: int = Field(default=1, ge=1, le=1024, description="fewest groups the autoscaler keeps (>= 1: a "
                           "fleet of 0 has nobody to measure load)")
    maxGroups: int = Field(ge=1, le=1024, description="most groups the autoscaler creates (>= minGroups)")
    targetTTFTSeconds: float | None = Field(default=None, gt=0, le=3600, description="time to first token the "
                                            "fleet is sized for: 95 % of requests within it")
    targetQueueSeconds: float | None = Field(default=None, gt=0, le=3600, description="queue wait the fleet is "
                                             "sized for instead of (or as well as) targetTTFTSeconds")
    scaleUpStabilizationSeconds: float = Field(default=30, ge=0, le=3600, description="a scale-up needs the load "
                                               "to ask for it this long (a burst that panics skips it)")
    scaleDownStabilizationSeconds: float = Field(default=120, ge=0, le=86400, description="a scale-down needs "
                                                 "the load to fit the smaller fleet with margin this long")
    maxStep: int = Field(default=10, ge=1, le=1024, description="most groups added or removed per decision")
    intervalSeconds: float = Field(default=5, ge=1, le=300, description="seconds between two reads of the "
                                   "groups' /v1/load and decisions")


class Template(_Model):
    env: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volumeMounts: list[dict[str, Any]] = Field(default_factory=list)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    nodeSelector: dict[str, str] = Field(default_factory=dict)


class DwdpGroupSpec(_Model):
    numGroups: int = Field(default=1, ge=0)
    dwdpSize: int = Field(ge=2)
    gpusPerPod: int = Field(default=1, ge=1)
    experts: Experts
    model: Model
    image: str = Field(min_length=1)
    resources: dict[str, Any] = Field(default_factory=dict)
    imex: Imex = Field(default_factory=Imex)
    topologyKey: str = Field(default="nvidia.com/gpu.clique", min_length=1)
    restartPolicy: RestartPolicy = Field(default_factory=RestartPolicy)
    rollout: Rollout = Field(default_factory=Rollout)
    template: Template = Field(default_factory=Template)
    sizing: Sizing | None = None
    kvTransfer: KvTransfer | None = None
    serving: Serving | None = None
    inferencePool: InferencePool | None = None
    autoscaling: Autoscaling | None = None
    httpPort: int = Field(default=DEFAULT_HTTP_PORT, ge=1, le=65535)
    storePort: int = Field(default=DEFAULT_STORE_PORT, ge=1, le=65535)

    @property
    def pods_per_group(self) -> int:
        return self.dwdpSize // self.gpusPerPod


Check = Callable[[DwdpGroupSpec], list[str]]
CHECKS: list[Check] = []


def register_check(fn: Check) -> Check:
    """Add a rule to ``validate_spec`` (decorator). ``fn(spec) -> list[str]`` of messages."""
    CHECKS.append(fn)
    return fn


# the shared rules' parameter names -> the DwdpGroup's field names (invariant 5)
SPEC_NAMES = {
    "num_experts_per_worker": "experts.numExpertsPerWorker",
    "num_prefetch_experts": "experts.numPrefetchExperts",
    "num_prefetch_slots": "experts.numPrefetchSlots",
    "num_experts": "experts.numExperts",
    "dwdp_size": "dwdpSize",
}
_SNAKE = re.compile(r"\b(" + "|".join(sorted(SPEC_NAMES, key=len, reverse=True)) + r")\b")


def in_spec_names(message: str) -> str:
    """A shared-rule message with the runtime's parameter names replaced by the spec's fields."""
    return _SNAKE.sub(lambda m: SPEC_NAMES[m.group(1)], message)


@register_check
def check_sharding(spec: DwdpGroupSpec) -> list[str]:
    e = spec.experts
    # num_groups=1: 0 groups is a valid scale-to-zero for the CRD; the group count is not a sharding rule here.
    return [f"spec: {in_spec_names(m)}" for m in sharding_errors(
        dwdp_size=spec.dwdpSize, num_experts=e.numExperts, num_experts_per_worker=e.numExpertsPerWorker,
        num_prefetch_experts=e.numPrefetchExperts, num_prefetch_slots=e.numPrefetchSlots, num_groups=1)]


@register_check
def check_gpus_per_pod(spec: DwdpGroupSpec) -> list[str]:
    if spec.dwdpSize % spec.gpusPerPod:
        return [f"spec.gpusPerPod={spec.gpusPerPod} must divide spec.dwdpSize={spec.dwdpSize} "
                f"(every pod runs the same number of ranks); e.g. gpusPerPod=1"]
    return []


HGX_FIX = "one HGX node: gpusPerPod = dwdpSize; several nodes: NVL72 with imex.mode ComputeDomain"


@register_check
def check_hgx_one_pod(spec: DwdpGroupSpec) -> list[str]:
    """Without an IMEX fabric a GPU allocation crosses processes only as a POSIX fd over a Unix
    socket, and that socket lives in one pod's network namespace: every rank of the group must be
    in one pod (one node). Pods on other nodes could never map each other's experts."""
    if spec.imex.mode == "None" and spec.gpusPerPod != spec.dwdpSize:
        return [f"spec.gpusPerPod={spec.gpusPerPod} with imex.mode None splits a group of "
                f"dwdpSize={spec.dwdpSize} ranks over {spec.pods_per_group} pods, which cannot map each "
                f"other's GPU memory without an IMEX fabric; {HGX_FIX}"]
    return []


@register_check
def check_model_source(spec: DwdpGroupSpec) -> list[str]:
    if (spec.model.path is None) == (spec.model.synthetic is None):
        return ["spec.model: set exactly one of model.path (a model directory) or model.synthetic "
                "(qwen3_moe, mixtral, deepseek_v3)"]
    return []


@register_check
def check_template_env(spec: DwdpGroupSpec) -> list[str]:
    """The pod contract's variables belong to the operator; other DWDP_* tuning knobs
    (e.g. DWDP_SM_GATHER_CTAS) may be set through template.env."""
    out = []
    for i, var in enumerate(spec.template.env):
        name = var.get("name")
        if not isinstance(name, str) or not name:
            out.append(f"spec.template.env[{i}]: every env entry needs a name")
        elif name in RESERVED_POD_ENV:
            out.append(f"spec.template.env[{i}]: {name} is set by the operator (docs/ENV_CONTRACT.md); remove it")
    return out


@register_check
def check_ports(spec: DwdpGroupSpec) -> list[str]:
    if spec.httpPort == spec.storePort:
        return [f"spec.httpPort and spec.storePort are both {spec.httpPort}; pick two different ports"]
    return []


def _pydantic_messages(err: ValidationError) -> list[str]:
    out = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        out.append(f"spec.{loc}: {e['msg']}" if loc else f"spec: {e['msg']}")
    return out


def parse_spec(raw: dict[str, Any] | None) -> tuple[DwdpGroupSpec | None, list[str]]:
    """Parse and validate; returns (spec, []) or (None or spec, messages). Never raises, whatever
    JSON ``raw`` is (a non-object spec is a message, not a crash)."""
    if raw is not None and not isinstance(raw, dict):
        return None, [f"spec: must be an object, got {type(raw).__name__}"]
    try:
        spec = DwdpGroupSpec.model_validate(dict(raw or {}))
    except ValidationError as err:
        return None, _pydantic_messages(err)
    errors: list[str] = []
    for check in CHECKS:
        errors.extend(check(spec))
    return spec, errors


def validate_spec(raw: dict[str, Any] | None) -> list[str]:
    """Every problem with a DwdpGroup spec as a message; ``[]`` when valid."""
    return parse_spec(raw)[1]
