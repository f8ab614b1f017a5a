"""What the DwdpGroup CRD carries that the pydantic models cannot say: names, subresources, printer
columns, the CEL rules, and the kind's own description. ``crdgen`` joins them with the schema it
generates from ``spec.DwdpGroupSpec`` and ``status_schema.DwdpGroupStatus``.

Invariants:
  1. ``SPEC_RULES`` are the cross-field rules of ``spec.validate_spec`` that CEL can state (servers
     >= 1.25 refuse a breaking object at admission; older ones skip CEL and the operator sets
     condition Invalid with the same rule). ``tests/operator/test_op_crd.py`` holds the two to each
     other with a property test; the wording shared with the operator's own messages is imported.
  2. Every ``jsonPath`` below names a field of the generated schema (tested): a renamed field cannot
     leave an empty column or a dead scale subresource behind.
"""

from __future__ import annotations

from typing import NamedTuple

from dwdp_runtime.contract import KV_TCP_PORTS

from .spec import DEGRADE_NEEDS_REPLICAS, GROUP, HGX_FIX, KIND, MAX_PORT, PLURAL, SERVING_BATCH_INVARIANT_GRAPHS, ELASTIC_GRAPHS
from .spec import KERNEL_CACHE_ONE_SOURCE

SINGULAR = KIND.lower()
LIST_KIND = f"{KIND}List"
SHORT_NAMES = ("dwdp",)
SCOPE = "Namespaced"
CRD_NAME = f"{PLURAL}.{GROUP}"

KIND_DESCRIPTION = (
    "A DwdpGroup serves the context (prefill) phase of one MoE model with DWDP: numGroups independent groups "
    "of dwdpSize GPUs; each rank holds numExpertsPerWorker experts and prefetches the others from its peers' "
    "GPU memory layer by layer. The operator creates the groups' pods (gang-scheduled inside one NVLink "
    "clique), their Services, NetworkPolicies, token Secret and IMEX ComputeDomain, restarts a whole group "
    "when one of its pods fails (or, with failurePolicy Degrade, recreates only that pod while the others "
    "serve), and reports per-group state in status. docs/OPERATOR.md.")
SPEC_DESCRIPTION = "the desired groups, their expert sharding, model and pod template"
STATUS_DESCRIPTION = "written by the operator only"

# kubectl scale / HPA: replicas are groups, the selector picks every worker pod
SCALE_SUBRESOURCE = {"specReplicasPath": ".spec.numGroups", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
SUBRESOURCES = {"status": {}, "scale": SCALE_SUBRESOURCE}


class PrinterColumn(NamedTuple):
    name: str
    type: str
    json_path: str
    description: str = ""
    wide: bool = False  # priority 1: shown by ``kubectl get -o wide`` only

    def to_crd(self) -> dict:
        out: dict = {"name": self.name, "type": self.type}
        if self.wide:
            out["priority"] = 1
        out["jsonPath"] = self.json_path
        if self.description:
            out["description"] = self.description
        return out


PRINTER_COLUMNS = (
    PrinterColumn("Groups", "integer", ".spec.numGroups", "desired DWDP groups"),
    PrinterColumn("Ready", "integer", ".status.readyGroups", "groups with every pod ready"),
    PrinterColumn("Restarts", "integer", ".status.totalRestarts", "group restarts since the last rollout"),
    PrinterColumn("Status", "string", ".status.state",
                  "Ready, Progressing, Degraded, Blocked (a child refused) or Invalid (the spec breaks a rule)"),
    PrinterColumn("Reason", "string", ".status.reason", "reason of the condition behind Status"),
    PrinterColumn("Age", "date", ".metadata.creationTimestamp"),
    PrinterColumn("ReadyRanks", "integer", ".status.readyRanks",
                  "ranks in Ready pods (a Degraded group counts only its serving ranks)", wide=True),
    PrinterColumn("DwdpSize", "integer", ".spec.dwdpSize", "ranks (GPUs) per group", wide=True),
    PrinterColumn("Experts/Worker", "integer", ".spec.experts.numExpertsPerWorker", "experts each rank holds",
                  wide=True),
    PrinterColumn("Transfer", "string", ".spec.experts.transfer", "how peer expert copies are issued", wide=True),
    PrinterColumn("Image", "string", ".spec.image", "worker image", wide=True),
)


#: ``DwdpGroupSpec.elastic`` in CEL (the property test of tests/operator/test_op_crd.py holds the two together)
ELASTIC = "self.experts.replicas > 1"
ELASTIC_STORES = ("an elastic group (experts.replicas > 1) serves rendezvous stores on ports storePort .. storePort + "
                  "dwdpSize (storePort, and a standby store per rank at storePort + 1 + rank)")


class CelRule(NamedTuple):
    rule: str
    message: str

    def to_crd(self) -> dict:
        return {"rule": self.rule, "message": self.message}


SPEC_RULES = (
    CelRule("self.dwdpSize % self.gpusPerPod == 0",
            "gpusPerPod must divide dwdpSize (every pod runs the same number of ranks)"),
    CelRule("self.imex.mode != 'None' || self.gpusPerPod == self.dwdpSize",
            "imex.mode None needs the whole group in one pod (no IMEX fabric: GPU memory crosses processes only "
            f"inside one pod); {HGX_FIX}"),
    CelRule("self.experts.numExpertsPerWorker <= self.experts.numExperts",
            "experts.numExpertsPerWorker must be <= experts.numExperts"),
    CelRule("self.experts.numPrefetchExperts <= self.experts.numExpertsPerWorker",
            "experts.numPrefetchExperts (stride) must be <= experts.numExpertsPerWorker, else experts between "
            "ranges are owned by no rank"),
    CelRule("(self.dwdpSize - 1) * self.experts.numPrefetchExperts + self.experts.numExpertsPerWorker "
            ">= self.experts.numExperts",
            "coverage rule (dwdpSize-1)*experts.numPrefetchExperts + experts.numExpertsPerWorker >= "
            "experts.numExperts fails: the last rank's range must reach the last expert"),
    CelRule("(self.dwdpSize - 1) * self.experts.numPrefetchExperts < self.experts.numExperts",
            "(dwdpSize-1)*experts.numPrefetchExperts must be < experts.numExperts: the last rank would start past "
            "the last expert and hold nothing"),
    CelRule("self.experts.replicas <= self.dwdpSize",
            "experts.replicas must be <= dwdpSize: every expert is stored on that many distinct ranks of a group "
            "(each step of replicas costs up to experts.numExpertsPerWorker more experts of memory per rank)"),
    CelRule("self.experts.numPrefetchSlots >= 2",
            "experts.numPrefetchSlots must be >= 2 so the next layer's copy overlaps this layer's compute"),
    CelRule("has(self.model.path) != has(self.model.synthetic)", "set exactly one of model.path or model.synthetic"),
    CelRule("self.httpPort != self.storePort", "httpPort and storePort must differ"),
    # degrade.pod_loss_errors (exact for every sharding the rules above admit: degrade invariant 4)
    CelRule("self.failurePolicy != 'Degrade' || self.experts.replicas > self.gpusPerPod",
            f"failurePolicy {DEGRADE_NEEDS_REPLICAS}"),
    # spec.check_standby_store_ports: an elastic group's stores use storePort .. storePort + dwdpSize
    CelRule(f"!({ELASTIC}) || self.storePort + self.dwdpSize <= {MAX_PORT}",
            f"{ELASTIC_STORES}: storePort + dwdpSize must be <= {MAX_PORT}; lower storePort"),
    CelRule(f"!({ELASTIC}) || self.httpPort < self.storePort || self.httpPort > self.storePort + self.dwdpSize",
            f"{ELASTIC_STORES}: set httpPort below storePort or above storePort + dwdpSize"),
    CelRule(f"!({ELASTIC}) || !has(self.kvTransfer) "
            f"|| self.kvTransfer.tcpPortBase + {KV_TCP_PORTS - 1} < self.storePort "
            f"|| self.kvTransfer.tcpPortBase > self.storePort + self.dwdpSize",
            f"{ELASTIC_STORES}: kvTransfer's {KV_TCP_PORTS} TCP ports from tcpPortBase must not overlap them; set "
            f"tcpPortBase above storePort + dwdpSize or to storePort - {KV_TCP_PORTS} or less"),
    # spec.serving_errors' elastic rule
    CelRule(f"!({ELASTIC}) || !has(self.serving) || !has(self.serving.cudaGraphs) || self.serving.cudaGraphs == 0",
            ELASTIC_GRAPHS),
)

#: rules of one spec object, on that object's schema (``self`` is the object): spec.autoscaling's cross-field
#: rules of ``autoscale.autoscaling_errors`` (tests/operator/test_op_autoscaling_spec.py holds the two to each
#: other, property test)
OBJECT_RULES = {
    # spec.serving: the rule of ``spec.serving_errors`` (batch-invariant attention finds the packed sequences on
    # the host, which a CUDA-graph replay cannot do)
    "serving": (
        CelRule("!(self.batchInvariant && has(self.cudaGraphs) && self.cudaGraphs > 0)", SERVING_BATCH_INVARIANT_GRAPHS),
    ),
    # spec.kernelCache: ``spec.check_kernel_cache``'s one-volume rule (its template rules are operator-only)
    "kernelCache": (
        CelRule("has(self.claimName) != has(self.hostPath)", KERNEL_CACHE_ONE_SOURCE),
    ),
    "autoscaling": (
        CelRule("self.minGroups <= self.maxGroups", "autoscaling.minGroups must not be above autoscaling.maxGroups"),
        CelRule("has(self.targetTTFTSeconds) || has(self.targetQueueSeconds)",
                "autoscaling: set targetTTFTSeconds and/or targetQueueSeconds"),
    ),
}
