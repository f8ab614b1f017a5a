"""The DwdpGroup spec as a pydantic model, and ``validate_spec``: every rule the operator enforces.

Invariants:
  1. This model IS the CRD's spec schema: field names, types, bounds, defaults and descriptions
     (``Field(description=...)``, what ``kubectl explain`` shows) are generated from it into
     ``crds/dwdpgroup.yaml`` by ``python -m dwdp_operator.crdgen``; a test fails when the file is stale.
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
     ``x-kubernetes-validations`` (``crd_extras.SPEC_RULES``; servers >= 1.25 refuse the object at admission);
     ``tests/operator/test_op_crd.py`` holds the two to each other with a property test.
     Operator-only: reserved ``template.env`` names and the planner's memory fit.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dwdp_runtime.config import DEFAULT_PREFETCH_SLOTS, MIN_PREFETCH_SLOTS, sharding_errors
from dwdp_runtime.serving_options import (BATCH_INVARIANT_GRAPHS_REASON, ELASTIC_GRAPHS_REASON, ServingOptions, camel,
                                         camel_field)
from dwdp_runtime.contract import (DEFAULT_HTTP_PORT, DEFAULT_STORE_PORT, DEFAULT_TRANSFER, KV_TCP_PORTS, LABEL_PREFIX,
                                   POD_ENV,
                                   RESERVED_POD_ENV, ModelDtype, ModelDtypeName, TransferMode, TuningEnv,
                                   standby_store_port)

GROUP = LABEL_PREFIX
# docs/ENV_CONTRACT.md: the variables the operator sets on every worker pod (manifests.worker_env)
CONTRACT_ENV: tuple[str, ...] = tuple(v.value for v in POD_ENV)
VERSION = "v1alpha1"
PLURAL = "dwdpgroups"
KIND = "DwdpGroup"


# Upper bounds the CRD states (the API server refuses past them at admission) and the operator holds too,
# so both refuse the same specs. None is a design limit: each sits far past any real deployment and only
# stops a typo (a numGroups of 1e9) from becoming an object the operator has to plan for.
MAX_GROUPS = 1024           # groups per DwdpGroup
MAX_DWDP_SIZE = 1024        # ranks per group (an NVL72 rack has 72 GPUs)
MAX_GPUS_PER_POD = 64       # ranks per pod (no node has more GPUs)
MAX_EXPERTS = 65536         # routed experts per MoE layer (DeepSeek-V3: 256)
MAX_PREFETCH_SLOTS = 64     # layers of peer experts buffered ahead (each slot is GPU memory)
MAX_RESTARTS = 10_000       # restartPolicy.maxRestarts


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class Experts(_Model):
    numExperts: int = Field(ge=1, le=MAX_EXPERTS, description=(
        "routed experts per MoE layer of the model (must match the checkpoint)"))
    numExpertsPerWorker: int = Field(ge=1, le=MAX_EXPERTS, description=(
        "k: experts each rank holds in its own GPU memory"))
    numPrefetchExperts: int = Field(ge=1, le=MAX_EXPERTS, description=(
        "prefetch stride s: rank r owns experts [r*s, r*s+k); s <= k, (dwdpSize-1)*s + k >= numExperts, "
        "(dwdpSize-1)*s < numExperts"))
    numPrefetchSlots: int = Field(default=DEFAULT_PREFETCH_SLOTS, ge=MIN_PREFETCH_SLOTS, le=MAX_PREFETCH_SLOTS,
                                  description=(f"layers of peer experts buffered ahead (>= {MIN_PREFETCH_SLOTS}: the "
                                               "next layer's copy overlaps this layer's compute)"))
    contentionOpt: bool = Field(default=False, description=(
        "order peer copies so that no two ranks read the same peer at once"))
    transfer: TransferMode = Field(default=DEFAULT_TRANSFER, description=(
        "how a rank issues a layer's peer copies: copy_engine (one copy per entry), batched (one batched copy "
        "per layer, CUDA 13 driver), sm_gather (SM kernel; opt-in, costs compute)"))
    replicas: int = Field(default=1, ge=1, le=MAX_DWDP_SIZE, description=(
        "r: every expert is stored on at least r distinct ranks of a group (1 <= r <= dwdpSize); each rank keeps "
        "its r-1 ring predecessors' experts as spares peers can pull from after a rank loss. Costs up to "
        "(r-1)*numExpertsPerWorker more experts of memory per rank; 1 = no spare copy (a lost rank's experts "
        "are gone with it)"))


class Model(_Model):
    path: str | None = Field(default=None, min_length=1, description=(
        "model directory (config.json + safetensors) inside the pod, e.g. on a volume from template.volumes"))
    synthetic: Literal["qwen3_moe", "mixtral", "deepseek_v3"] | None = Field(default=None, description=(
        "seeded tiny model architecture generated in the pod (tests and demos)"))
    dtype: ModelDtypeName = Field(default=ModelDtype.BFLOAT16.value, description="dtype the weights are loaded in")


class Sizing(_Model):
    """Planner inputs (optional): a model preset or config.json path and a hardware preset."""

    model: str = Field(min_length=1, description=(
        "planner model preset (deepseek-r1, deepseek-v3, qwen3-235b-a22b, qwen3-30b-a3b, mixtral-8x22b, "
        "gpt-oss-120b) or a config.json path readable by the operator"))
    hardware: str = Field(default="h200-hgx", min_length=1, description=(
        "hardware preset: gb200-nvl72, b200-hgx, h200-hgx, h100-hgx"))
    weightDtype: Literal["bf16", "fp8", "nvfp4", "mxfp4"] = Field(default="bf16", description=(
        "dtype of the expert weights the planner sizes"))
    isl: int = Field(default=8192, ge=1, description="input length the predicted speedup is computed for")
    minKvGiB: float = Field(default=0.0, ge=0, description="KV cache (GiB per GPU) the deployment must keep")


class Imex(_Model):
    mode: Literal["ComputeDomain", "None"] = Field(default="ComputeDomain", description=(
        "ComputeDomain: an IMEX domain (NVIDIA DRA driver) so pods on several nodes of an NVL72 rack share GPU "
        "memory; None: no IMEX, the whole group in one pod on one HGX node (gpusPerPod = dwdpSize)"))


class RestartPolicy(_Model):
    maxRestarts: int = Field(default=5, ge=0, le=MAX_RESTARTS, description=(
        "group restarts (since the last rollout) before the group is marked Failed and left down"))
    backoffSeconds: int = Field(default=10, ge=0, le=3600, description=(
        "delay before the n-th restart: backoffSeconds * 2^n, capped at 300 s"))
    # a group split between bound pods and a pod the scheduler cannot place (e.g. its first pod chose
    # a clique that lost a node) is a dead end: restart it away from those nodes after this long; 0 = never
    unschedulableSeconds: int = Field(default=300, ge=0, le=86400, description=(
        "a group whose pods are partly bound while another cannot be scheduled (placement dead end) is "
        "restarted away from those nodes after this long; 0 = never"))


class FailurePolicy(StrEnum):
    """``spec.failurePolicy``: what the operator does when one pod of a running group fails."""

    RESTART_GROUP = "RestartGroup"  # every pod of the group is recreated at attempt+1 (backoff, maxRestarts)
    DEGRADE = "Degrade"             # only the failed pod is recreated; the survivors keep serving (issue #30)


# spec.degrade defaults: a pod (node, GPU) that fails again and again is recreated at most this often per
# group within the window before the group restarts as a whole (its own backoff and maxRestarts then apply)
DEFAULT_MAX_POD_RECREATIONS = 3
DEFAULT_RECREATION_WINDOW_S = 600
MAX_RECREATION_WINDOW_S = 86400


#: why Degrade needs replicas (validate_spec's message and its CEL twin's, crd_extras.SPEC_RULES)
DEGRADE_NEEDS_REPLICAS = ("Degrade needs experts.replicas > gpusPerPod: a failed pod takes its gpusPerPod ranks "
                          "with it, and only more replicas than that keep every expert on a surviving rank (with "
                          "replicas 1 a lost rank's experts are gone with it and the group must restart anyway)")


class Degrade(_Model):
    """The budget of ``failurePolicy: Degrade`` (docs/OPERATOR.md, "Degrade")."""

    maxPodRecreations: int = Field(default=DEFAULT_MAX_POD_RECREATIONS, ge=0, le=MAX_RESTARTS, description=(
        "pods of one group recreated alone within windowSeconds; one more failure restarts the whole group "
        "(restartPolicy's backoff and maxRestarts); 0 = every failure restarts the group"))
    windowSeconds: int = Field(default=DEFAULT_RECREATION_WINDOW_S, ge=1, le=MAX_RECREATION_WINDOW_S,
                               description="the sliding window maxPodRecreations counts in")


class Rollout(_Model):
    maxUnavailableGroups: int = Field(default=1, ge=1, le=MAX_GROUPS, description=(
        "Ready groups replaced at once during a rollout (groups not Ready are replaced at once)"))


class KvTransfer(_Model):
    """KV handoff to decode engines over NIXL (docs/KV_TRANSFER.md): each rank keeps requested KV in a
    region of ``budgetBytes`` (GPU memory), freed when pulled or after ``ttlSeconds``."""

    budgetBytes: int = Field(ge=0, description=(
        "KV region per rank in bytes (GPU memory); 0 = off; a full region answers 429"))
    blockBytes: int = Field(default=1 << 20, ge=64, multiple_of=64, description="allocation unit of the region")
    ttlSeconds: float = Field(default=30.0, gt=0, description="seconds unclaimed KV is kept before it is freed")
    leaseSeconds: float = Field(default=30.0, gt=0, description=(
        "seconds a claimed pull may take before its KV is freed"))
    # UCX's TCP listeners use [tcpPortBase, tcpPortBase + KV_TCP_PORTS) (the NetworkPolicy opens it)
    tcpPortBase: int = Field(default=30000, ge=1024, le=65536 - KV_TCP_PORTS, description=(
        f"first of {KV_TCP_PORTS} TCP ports the ranks' NIXL/UCX agents listen on (UCX_TCP_PORT_RANGE); the "
        f"group's NetworkPolicy opens them"))


class Serving(_Model):
    """The workers' HTTP front (``contract.ServingEnv``); absent = the worker's defaults. Each field is
    ``dwdp_runtime.serving_options.ServingOptions``' of the same name in snake_case: its default, bounds and
    description are copied from there (one definition for the CLI, the env contract and this spec)."""

    maxQueue: int = camel_field("max_queue")
    maxNumTokens: int = camel_field("max_num_tokens")
    maxNumSeqs: int = camel_field("max_num_seqs")
    maxNewTokens: int = camel_field("max_new_tokens")
    servedModelName: str | None = camel_field("served_model_name")
    cudaGraphs: int | None = camel_field("cuda_graphs")
    batchInvariant: bool = camel_field("batch_invariant")

    def options(self) -> ServingOptions:
        return ServingOptions(**{f: getattr(self, camel(f)) for f in ServingOptions.model_fields})


class EndpointPicker(_Model):
    """The Gateway API Inference Extension's endpoint picker (EPP) Service that routes to the pool."""

    name: str = Field(min_length=1, description="the EPP Service's name (same namespace)")
    port: int = Field(default=9002, ge=1, le=65535, description=(  # the EPP's gRPC ext-proc port (its default)
        "the EPP Service's port (the EPP's ext-proc default 9002)"))
    failureMode: Literal["FailOpen", "FailClose"] = Field(default="FailClose", description=(
        "what the gateway does when the EPP does not answer"))


class InferencePool(_Model):
    """Ask for an ``InferencePool`` (inference.networking.k8s.io/v1) over this DwdpGroup's serving pods."""

    endpointPicker: EndpointPicker = Field(description=(
        "the endpoint picker (EPP) Service the pool's gateway asks for an endpoint"))


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
    panicHoldSeconds: float = Field(default=60, ge=0, le=3600, description="no scale-down this long after a "
                                    "panic (a burst that asked for >= 2x the groups, or a queue past twice the "
                                    "wait budget)")
    maxStep: int = Field(default=10, ge=1, le=1024, description="most groups added or removed per decision")
    intervalSeconds: float = Field(default=5, ge=1, le=300, description="seconds between two reads of the "
                                   "groups' /v1/load and decisions")


#: where a worker pod mounts spec.kernelCache's volume (DWDP_COMPILE_CACHE_DIR points there)
KERNEL_CACHE_PATH = "/var/cache/dwdp/kernels"
#: the pod volume of spec.kernelCache (a template volume may not take this name)
KERNEL_CACHE_VOLUME = "dwdp-kernel-cache"


KERNEL_CACHE_ONE_SOURCE = ("kernelCache: set exactly one of claimName (a PersistentVolumeClaim) or hostPath (a "
                           "directory on each node)")


class KernelCache(_Model):
    """A volume that outlives the pod for the workers' kernel compile caches (``DWDP_COMPILE_CACHE_DIR``:
    Triton, CuTe DSL, inductor — ``dwdp_runtime.compile_cache``). Worker pods never restart in place (a failed
    pod is replaced), so without it every replacement pod — a group restart, a Degrade rejoin, a scale-up —
    compiles its kernels again. Exactly one of claimName or hostPath (cross-field: ``check_kernel_cache``)."""

    claimName: str | None = Field(default=None, min_length=1, description=(
        "a PersistentVolumeClaim in the DwdpGroup's namespace, shared by every worker pod (ReadWriteMany when "
        "the groups span nodes); the pods' fsGroup 10001 makes it writable"))
    hostPath: str | None = Field(default=None, min_length=2, pattern=r"^/", description=(
        "an absolute directory on each node (DirectoryOrCreate), writable by uid 10001: pods on one node share "
        "it; a cache that cannot be written is skipped with a warning, never fatal"))


class Template(_Model):
    env: list[dict[str, Any]] = Field(default_factory=list, description=(
        "extra container env (the pod contract's DWDP_* variables are set by the operator and refused here)"))
    volumes: list[dict[str, Any]] = Field(default_factory=list, description=(
        "extra pod volumes (e.g. the model checkpoint)"))
    volumeMounts: list[dict[str, Any]] = Field(default_factory=list, description="extra container volume mounts")
    tolerations: list[dict[str, Any]] = Field(default_factory=list, description=(
        "pod tolerations (e.g. for tainted GPU nodes)"))
    nodeSelector: dict[str, str] = Field(default_factory=dict, description="pod node selector")


class DwdpGroupSpec(_Model):
    numGroups: int = Field(default=1, ge=0, le=MAX_GROUPS, description=(
        "number of DWDP groups (the scale subresource's replicas; 0 scales to zero)"))
    dwdpSize: int = Field(ge=2, le=MAX_DWDP_SIZE, description=(
        "ranks (GPUs) per group; every rank maps the experts of every other rank of its group"))
    gpusPerPod: int = Field(default=1, ge=1, le=MAX_GPUS_PER_POD, description=(
        "ranks per pod; must divide dwdpSize; with imex.mode None it must equal dwdpSize (one pod per group on "
        "one HGX node)"))
    experts: Experts = Field(description=(
        "expert sharding: rank r owns experts [r*s, r*s+k) of numExperts (s = numPrefetchExperts, "
        "k = numExpertsPerWorker)"))
    model: Model = Field(description="the model the workers serve; exactly one of path or synthetic")
    image: str = Field(min_length=1, description="worker container image (Dockerfile target worker)")
    resources: dict[str, Any] = Field(default_factory=dict, description=(
        "container resources; nvidia.com/gpu is set to gpusPerPod by the operator"))
    imex: Imex = Field(default_factory=Imex, description="how a group's GPUs map each other's memory")
    topologyKey: str = Field(default="nvidia.com/gpu.clique", min_length=1, description=(
        "node label whose value names an NVLink clique; a group never spans two values"))
    restartPolicy: RestartPolicy = Field(default_factory=RestartPolicy, description=(
        "how a group restarts as a whole when a pod of it fails (failurePolicy RestartGroup, or a Degrade that "
        "cannot keep the group: coverage lost, budget spent): backoff and budget"))
    failurePolicy: FailurePolicy = Field(default=FailurePolicy.RESTART_GROUP, description=(
        "RestartGroup: a failed pod restarts its whole group (every pod, next attempt). Degrade: only the failed "
        "pod is recreated (same name, same attempt; the worker rejoins the running group) while the others keep "
        "serving, as long as every expert keeps a surviving holder and spec.degrade's budget lasts; needs "
        "experts.replicas > gpusPerPod"))
    degrade: Degrade = Field(default_factory=Degrade, description=(
        "the budget of failurePolicy Degrade (ignored under RestartGroup)"))
    rollout: Rollout = Field(default_factory=Rollout, description="how a template change replaces running groups")
    template: Template = Field(default_factory=Template, description="additions to every worker pod")
    kernelCache: KernelCache | None = Field(default=None, description=(
        "keep the workers' kernel compile caches on a volume that outlives the pod (mounted at "
        f"{KERNEL_CACHE_PATH}, DWDP_COMPILE_CACHE_DIR set to it), so a replacement pod compiles nothing; "
        "absent: each pod compiles into its own emptyDir home"))
    sizing: Sizing | None = Field(default=None, description=(
        "optional planner inputs; the operator refuses a group whose experts and pool slots cannot fit GPU "
        "memory and shows the predicted DWDP gain in status.sizing"))
    kvTransfer: KvTransfer | None = Field(default=None, description=(
        "KV handoff for disaggregated serving (docs/KV_TRANSFER.md): each rank keeps the KV of requests with "
        "kv_transfer_params.do_remote_decode in a NIXL-registered region for a decode engine to pull"))
    serving: Serving | None = Field(default=None, description=(
        "the workers' HTTP front, passed to every pod through the env contract (DWDP_MAX_QUEUE, "
        "DWDP_MAX_NUM_TOKENS, DWDP_MAX_NUM_SEQS, DWDP_MAX_NEW_TOKENS, DWDP_SERVED_MODEL_NAME, DWDP_CUDA_GRAPHS, "
        "DWDP_BATCH_INVARIANT); "
        "absent: the worker's defaults; changing it rolls the groups"))
    inferencePool: InferencePool | None = Field(default=None, description=(
        "create an InferencePool (inference.networking.k8s.io/v1, Gateway API Inference Extension) selecting "
        "this group's serving pods (llm-d.ai/role: prefill) on httpPort; removing it deletes the pool"))
    autoscaling: Autoscaling | None = Field(default=None, description=(
        "prefill-aware autoscaling: the operator sets numGroups from the groups' GET /v1/load within "
        "[minGroups, maxGroups] (docs/OPERATOR.md, Autoscaling); absent: numGroups is yours (kubectl scale, HPA)"))
    httpPort: int = Field(default=DEFAULT_HTTP_PORT, ge=1, le=65535, description=(
        "workers' HTTP port: API, /healthz, /readyz, /metrics"))
    storePort: int = Field(default=DEFAULT_STORE_PORT, ge=1, le=65535, description=(
        "rank 0's rendezvous store port (reachable only from the DwdpGroup's own workers); an elastic group "
        "(experts.replicas > 1) also uses storePort+1 .. storePort+dwdpSize, a standby store per rank at "
        "storePort+1+rank, which httpPort and kvTransfer's ports must avoid"))

    @property
    def pods_per_group(self) -> int:
        return self.dwdpSize // self.gpusPerPod

    @property
    def elastic(self) -> bool:
        """A group that survives a rank loss in place (``dwdp_runtime.config.DwdpConfig.elastic``): spare expert
        copies, experts.replicas > 1. (The runtime's other half, ``on_uncovered=reload``, is no spec field yet.)
        Every rank of such a group hosts a standby store its survivors move to when the store host is lost."""
        return self.experts.replicas > 1

    @property
    def store_ports(self) -> tuple[int, int]:
        """The first and last TCP port a worker pod may serve a rendezvous store on: storePort (the group's store,
        on rank 0's pod) and, in an elastic group, every rank's standby store (``contract.standby_store_port``:
        storePort + 1 + rank, up to storePort + dwdpSize)."""
        if not self.elastic:
            return self.storePort, self.storePort
        return self.storePort, standby_store_port(self.storePort, self.dwdpSize - 1)


Check = Callable[[DwdpGroupSpec], list[str]]
CHECKS: list[Check] = []


def register_check(fn: Check) -> Check:
    """Add a rule to ``validate_spec`` (decorator). ``fn(spec) -> list[str]`` of messages."""
    CHECKS.append(fn)
    return fn


SERVING_BATCH_INVARIANT_GRAPHS = ("serving.batchInvariant excludes serving.cudaGraphs > 0: "
                                  f"{BATCH_INVARIANT_GRAPHS_REASON}; leave cudaGraphs unset, set it to 0, or set "
                                  "batchInvariant: false")


ELASTIC_GRAPHS = (f"an elastic group (experts.replicas > 1) cannot replay CUDA graphs: {ELASTIC_GRAPHS_REASON}; leave "
                  "serving.cudaGraphs unset (off in an elastic group) or set it to 0")


@register_check
def serving_errors(spec: DwdpGroupSpec) -> list[str]:
    """spec.serving's cross-field rules (the CRD's CEL twins: ``crd_extras.OBJECT_RULES["serving"]`` and the
    elastic rule of ``crd_extras.SPEC_RULES``). An unset cudaGraphs is never refused: the worker turns graphs on
    only where they can run (``prefill_graphs.rank_cuda_graphs``)."""
    s = spec.serving
    if s is None or not s.cudaGraphs:
        return []
    if s.batchInvariant:
        return [f"spec.{SERVING_BATCH_INVARIANT_GRAPHS} (cudaGraphs={s.cudaGraphs})"]
    if spec.elastic:
        return [f"spec: {ELASTIC_GRAPHS} (cudaGraphs={s.cudaGraphs}, experts.replicas={spec.experts.replicas})"]
    return []


# the shared rules' parameter names -> the DwdpGroup's field names (invariant 5)
SPEC_NAMES = {
    "num_experts_per_worker": "experts.numExpertsPerWorker",
    "num_prefetch_experts": "experts.numPrefetchExperts",
    "num_prefetch_slots": "experts.numPrefetchSlots",
    "num_experts": "experts.numExperts",
    "dwdp_size": "dwdpSize",
    "expert_replicas": "experts.replicas",
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
        num_prefetch_experts=e.numPrefetchExperts, num_prefetch_slots=e.numPrefetchSlots, num_groups=1,
        expert_replicas=e.replicas)]


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
def check_kernel_cache(spec: DwdpGroupSpec) -> list[str]:
    """spec.kernelCache names one volume, and the template does not take its name, path or variable."""
    kc = spec.kernelCache
    if kc is None:
        return []
    out = []
    if (kc.claimName is None) == (kc.hostPath is None):
        out.append(f"spec.{KERNEL_CACHE_ONE_SOURCE}")
    if any(v.get("name") == KERNEL_CACHE_VOLUME for v in spec.template.volumes):
        out.append(f"spec.template.volumes: the name {KERNEL_CACHE_VOLUME} is spec.kernelCache's; rename the volume")
    if any(m.get("mountPath") == KERNEL_CACHE_PATH for m in spec.template.volumeMounts):
        out.append(f"spec.template.volumeMounts: {KERNEL_CACHE_PATH} is spec.kernelCache's mount; use another path")
    if any(e.get("name") == str(TuningEnv.COMPILE_CACHE_DIR) for e in spec.template.env):
        out.append(f"spec.template.env: {TuningEnv.COMPILE_CACHE_DIR} is set from spec.kernelCache; remove one "
                   f"of them")
    return out


@register_check
def check_ports(spec: DwdpGroupSpec) -> list[str]:
    if spec.httpPort == spec.storePort:
        return [f"spec.httpPort and spec.storePort are both {spec.httpPort}; pick two different ports"]
    return []


MAX_PORT = 65535  # TCP


def elastic_store_ports(spec: DwdpGroupSpec) -> str:
    """How a message names the store ports of an elastic group (``DwdpGroupSpec.store_ports``)."""
    first, last = spec.store_ports
    return (f"an elastic group (experts.replicas={spec.experts.replicas} > 1) serves rendezvous stores on ports "
            f"{first}-{last} (storePort, and a standby store per rank at storePort+1+rank)")


@register_check
def check_standby_store_ports(spec: DwdpGroupSpec) -> list[str]:
    """An elastic group's standby stores (``DwdpGroupSpec.store_ports``) need ports of their own: inside TCP's range,
    apart from the HTTP port and from the KV handoff's UCX ports (CEL twins: ``crd_extras.SPEC_RULES``)."""
    if not spec.elastic:
        return []
    first, last = spec.store_ports
    out = []
    if last > MAX_PORT:
        out.append(f"spec.storePort={spec.storePort}: {elastic_store_ports(spec)}, past {MAX_PORT}; set storePort to "
                   f"{MAX_PORT - spec.dwdpSize} or less")
    if first < spec.httpPort <= last:  # == storePort: check_ports says so already
        out.append(f"spec.httpPort={spec.httpPort}: {elastic_store_ports(spec)}; set httpPort below {first} or "
                   f"above {last}")
    if (kv := spec.kvTransfer) is not None:
        kv_last = kv.tcpPortBase + KV_TCP_PORTS - 1
        if kv.tcpPortBase <= last and first <= kv_last:
            out.append(f"spec.kvTransfer.tcpPortBase={kv.tcpPortBase}: the KV handoff's ports "
                       f"{kv.tcpPortBase}-{kv_last} overlap the stores' ({elastic_store_ports(spec)}); set tcpPortBase "
                       f"above {last} or to {first - KV_TCP_PORTS} or less")
    return out


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
