"""Pure builders of every child object of a DwdpGroup (plain dicts, ready for the API).

Children of DwdpGroup ``<name>`` in namespace ``<ns>`` (docs/OPERATOR.md lists them for users):
  1. Secret ``<name>-token``            — the group token (DWDP_TOKEN), created once, never rotated here.
  2. Service ``<name>``                 — client Service over ready pods with ``dwdp.io/serving=true``.
  3. ComputeDomain ``<name>-imex``      — one IMEX domain per DwdpGroup (imex.mode=ComputeDomain); pods
                                          claim its channel through ``spec.resourceClaims`` with the
                                          ResourceClaimTemplate ``<name>-imex-channel`` it creates.
  4. headless Service ``<name>-ranks`` over every worker pod (publishNotReadyAddresses, so ranks find
     rank 0's store before readiness; each pod is ``<pod>.<name>-ranks``, as LeaderWorkerSet's shared
     subdomain) and NetworkPolicy ``<name>`` — one of each per DwdpGroup, not per group: every group's
     pods share the token and the image, so the DwdpGroup is the trust boundary, and each extra
     Service costs the API server two more writes per group (the controller manager's Endpoints and
     EndpointSlice; bench/operator_scale.py);
  5. per group g: pods ``<name>-g<g>-p<i>``, i < dwdpSize/gpusPerPod.
Invariants:
  * every child carries one controller ownerReference to the DwdpGroup (garbage collection);
  * the pod env is exactly docs/ENV_CONTRACT.md (+ DWDP_COMPILE_CACHE_DIR with spec.kernelCache), then the
    user's template.env (DWDP_* refused by validation) — tests compare the names with the contract table;
  * a gang's pods are created gated (scheduling gate ``dwdp.io/gang``) and labelled
    ``dwdp.io/gang=pending``, and ``lift_gate_patch`` ungates them once every pod of the attempt
    exists; or, when the whole gang is created at once (``whole=True``, desired invariant 2a),
    without the gate and labelled ``dwdp.io/gang=complete`` from the start (no lift patches);
  * the NetworkPolicy admits a worker's store ports (storePort; in an elastic group the standby stores' too,
    storePort .. storePort + dwdpSize: ``DwdpGroupSpec.store_ports``) only from worker pods of the same DwdpGroup
    (same ``dwdp.io/name``), the HTTP port from anywhere, nothing else;
  * worker pods run as non-root (uid 10001) with a read-only root filesystem, no privilege
    escalation and no capabilities; ``/tmp`` and the home directory (caches) are emptyDirs; with
    ``spec.kernelCache`` the kernel compile caches are on its volume (``DWDP_COMPILE_CACHE_DIR``) instead;
  * the token is only ever referenced (``secretKeyRef``), never written into a pod spec;
  * ``template_hash`` covers every spec field that shapes a pod, and nothing else (numGroups,
    restartPolicy and rollout changes never roll pods).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from dwdp_runtime.contract import (KV_TCP_PORTS, LLMD_ROLE_PREFILL, POD_PLACEHOLDER, TOKEN_SECRET_KEY, Backend,
                                   ElasticEnv, KvEnv, LayoutEnv, PortName, TuningEnv)
from dwdp_runtime.contract import PodEnvVar as E

from . import labels as L
from .spec import GROUP, KERNEL_CACHE_PATH, KERNEL_CACHE_VOLUME, KIND, VERSION, DwdpGroupSpec

CD_API_VERSION = "resource.nvidia.com/v1beta1"
IP_API_VERSION = "inference.networking.k8s.io/v1"  # the Gateway API Inference Extension's InferencePool
IMEX_CLAIM = "imex-channel"
WORKER_UID = 10001  # the worker image's user (Dockerfile: useradd --uid 10001)
WORKER_HOME = "/home/dwdp"
# writable scratch on a read-only root: (volume name, mount path)
SCRATCH = (("dwdp-tmp", "/tmp"), ("dwdp-home", WORKER_HOME))
STARTUP_FAILURE_THRESHOLD = 360  # x 10 s = 1 h for weight loading before liveness takes over
POD_IP_FIELD = "status.podIP"    # downward API field of the pod's IP (KvEnv.POD_IP)


def token_secret_name(name: str) -> str:
    return f"{name}-token"


def rank_service_name(name: str) -> str:
    return f"{name}-ranks"


def network_policy_name(name: str) -> str:
    return name


def pod_name(name: str, g: int, i: int | str) -> str:
    return f"{name}-g{g}-p{i}"


def pod_address(*, name: str, ns: str, g: int, i: int | str) -> str:
    """Where pod ``i`` of group ``g`` answers: its hostname under the DwdpGroup's headless Service (``rank_service``;
    the pod's ``hostname`` and ``subdomain``). ``i`` may be ``POD_PLACEHOLDER`` (the elastic pod address template)."""
    return f"{pod_name(name, g, i)}.{rank_service_name(name)}.{ns}.svc"


def compute_domain_name(name: str) -> str:
    return f"{name}-imex"


def claim_template_name(name: str) -> str:
    return f"{name}-imex-channel"


def template_hash(spec: DwdpGroupSpec) -> str:
    # kvTransfer, serving and kernelCache shape the pod, but an absent section must not change existing groups' hash;
    # inferencePool is not pod-shaping: adding or removing an InferencePool never restarts a group;
    # autoscaling only moves numGroups; failurePolicy and degrade only decide what a failure does (switching
    # them never restarts a group, and an operator upgrade that adds them keeps every group's hash)
    unset = {k for k in ("kvTransfer", "serving", "kernelCache") if getattr(spec, k) is None}
    shaping = spec.model_dump(mode="json", exclude={"numGroups", "restartPolicy", "rollout", "sizing",
                                                    "inferencePool", "autoscaling", "failurePolicy",
                                                    "degrade"} | unset)
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:10]


def owner_ref(name: str, uid: str) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(name: str, ns: str, owner: str, uid: str, component: str, extra: dict | None = None) -> dict:
    labels = {L.NAME: owner, L.MANAGED_BY: L.MANAGER, L.COMPONENT: component, **(extra or {})}
    return {"name": name, "namespace": ns, "labels": labels, "ownerReferences": [owner_ref(owner, uid)]}


def token_secret(*, name: str, ns: str, uid: str, token: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(token_secret_name(name), ns, name, uid, "token"),
            "stringData": {TOKEN_SECRET_KEY: token}}


def client_service(*, name: str, ns: str, uid: str, spec: DwdpGroupSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(name, ns, name, uid, "client"),
            "spec": {"selector": {L.NAME: name, L.SERVING: "true"},
                     "ports": [{"name": PortName.HTTP, "port": spec.httpPort, "targetPort": PortName.HTTP}]}}


def workers_selector(name: str) -> dict[str, str]:
    """Every worker pod of DwdpGroup ``name`` (the rank Service's and the NetworkPolicy's selector)."""
    return {L.NAME: name, L.COMPONENT: L.WORKER_COMPONENT}


def rank_service(*, name: str, ns: str, uid: str, spec: DwdpGroupSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(rank_service_name(name), ns, name, uid, "ranks"),
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": workers_selector(name),
                     "ports": [{"name": PortName.STORE, "port": spec.storePort, "targetPort": PortName.STORE},
                               {"name": PortName.HTTP, "port": spec.httpPort, "targetPort": PortName.HTTP}]}}


def network_policy(*, name: str, ns: str, uid: str, spec: DwdpGroupSpec) -> dict[str, Any]:
    """Ingress to the worker pods: the store ports (``DwdpGroupSpec.store_ports``: storePort, and in an elastic
    group every rank's standby store up to storePort + dwdpSize) only from the DwdpGroup's own workers; HTTP from
    anywhere (clients, the operator's /healthz reads, probes); with ``kvTransfer`` the UCX TCP port
    range from anywhere (decode engines pull KV there); every other port closed."""
    own = workers_selector(name)
    first, last = spec.store_ports
    stores = {"protocol": "TCP", "port": first, **({"endPort": last} if last > first else {})}
    kv = [] if spec.kvTransfer is None else [{"ports": [{"protocol": "TCP", "port": spec.kvTransfer.tcpPortBase,
                                                         "endPort": spec.kvTransfer.tcpPortBase + KV_TCP_PORTS - 1}]}]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(network_policy_name(name), ns, name, uid, "workers"),
            "spec": {"podSelector": {"matchLabels": own}, "policyTypes": ["Ingress"],
                     "ingress": [
                         {"ports": [stores], "from": [{"podSelector": {"matchLabels": own}}]},
                         {"ports": [{"protocol": "TCP", "port": spec.httpPort}]},
                         *kv,
                     ]}}


def compute_domain(*, name: str, ns: str, uid: str) -> dict[str, Any]:
    # numNodes: 0 lets the domain follow the pods that claim its channel (groups scale without an
    # edit here); the NVIDIA DRA driver then runs IMEX daemons on exactly the nodes of those pods.
    return {"apiVersion": CD_API_VERSION, "kind": "ComputeDomain",
            "metadata": _meta(compute_domain_name(name), ns, name, uid, "imex"),
            "spec": {"numNodes": 0,
                     "channel": {"resourceClaimTemplate": {"name": claim_template_name(name)}}}}


def inference_pool_selector(name: str) -> dict[str, str]:
    """The pods an InferencePool routes to: this DwdpGroup's workers that are behind its Service
    (draining pods leave it with ``dwdp.io/serving``), in llm-d's prefill role."""
    return {L.NAME: name, L.SERVING: "true", L.LLMD_ROLE: LLMD_ROLE_PREFILL}


def inference_pool(*, name: str, ns: str, uid: str, spec: DwdpGroupSpec) -> dict[str, Any]:
    epp = spec.inferencePool.endpointPicker
    return {"apiVersion": IP_API_VERSION, "kind": "InferencePool",
            "metadata": _meta(name, ns, name, uid, "inference-pool"),
            "spec": {"selector": {"matchLabels": inference_pool_selector(name)},
                     "targetPorts": [{"number": spec.httpPort}],
                     "endpointPickerRef": {"kind": "Service", "name": epp.name, "port": {"number": epp.port},
                                           "failureMode": epp.failureMode}}}


def _kernel_cache_volumes(spec: DwdpGroupSpec) -> list[dict]:
    """spec.kernelCache's volume (none when absent: the caches stay in the pod's emptyDir home)."""
    kc = spec.kernelCache
    if kc is None:
        return []
    if kc.claimName is not None:
        return [{"name": KERNEL_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": kc.claimName}}]
    return [{"name": KERNEL_CACHE_VOLUME, "hostPath": {"path": kc.hostPath, "type": "DirectoryOrCreate"}}]


def _kernel_cache_mounts(spec: DwdpGroupSpec) -> list[dict]:
    return [{"name": KERNEL_CACHE_VOLUME, "mountPath": KERNEL_CACHE_PATH}] if spec.kernelCache else []


def _kernel_cache_env(spec: DwdpGroupSpec) -> list[dict]:
    return [{"name": str(TuningEnv.COMPILE_CACHE_DIR), "value": KERNEL_CACHE_PATH}] if spec.kernelCache else []


def worker_env(*, name: str, ns: str, g: int, i: int, attempt: int, spec: DwdpGroupSpec) -> list[dict]:
    """The env of docs/ENV_CONTRACT.md, in the contract's order."""
    e, m = spec.experts, spec.model
    store = pod_address(name=name, ns=ns, g=g, i=0)  # rank 0's pod hosts the group's store
    plain = [
        (E.JOB, name), (E.NAMESPACE, ns), (E.GROUP, g), (E.POD_INDEX, i),
        (E.RANK_BASE, i * spec.gpusPerPod), (E.GPUS_PER_POD, spec.gpusPerPod),
        (E.SIZE, spec.dwdpSize), (E.STORE_ADDR, store), (E.STORE_PORT, spec.storePort),
        (E.ATTEMPT, attempt),
    ]
    env = [{"name": str(k), "value": str(v)} for k, v in plain]
    env.append({"name": str(E.TOKEN),
                "valueFrom": {"secretKeyRef": {"name": token_secret_name(name), "key": TOKEN_SECRET_KEY}}})
    rest = [
        (E.NUM_EXPERTS, e.numExperts), (E.EXPERTS_PER_WORKER, e.numExpertsPerWorker),
        (E.PREFETCH_STRIDE, e.numPrefetchExperts), (E.PREFETCH_SLOTS, e.numPrefetchSlots),
        (E.CONTENTION_OPT, "true" if e.contentionOpt else "false"), (E.TRANSFER, e.transfer),
        (E.MODEL, m.path or ""), (E.MODEL_SYNTHETIC, m.synthetic or ""), (E.DTYPE, m.dtype),
        (E.BACKEND, Backend.AUTO), (E.HTTP_PORT, spec.httpPort),
    ]
    env += [{"name": str(k), "value": str(v)} for k, v in rest]
    if e.replicas != 1:  # contract.LayoutEnv: absent = 1, so r = 1 pods render exactly as before
        env.append({"name": str(LayoutEnv.EXPERT_REPLICAS), "value": str(e.replicas)})
    if spec.elastic:  # contract.ElasticEnv: where a survivor finds any rank's standby store (the store failover)
        env.append({"name": str(ElasticEnv.POD_ADDR_TEMPLATE),
                    "value": pod_address(name=name, ns=ns, g=g, i=POD_PLACEHOLDER)})
    if (kv := spec.kvTransfer) is not None:  # contract.POD_ENV_OPTIONAL: only when the spec asks for it
        env += [{"name": str(k), "value": str(v)} for k, v in (
            (KvEnv.BUDGET_BYTES, kv.budgetBytes), (KvEnv.BLOCK_BYTES, kv.blockBytes),
            (KvEnv.TTL_S, kv.ttlSeconds), (KvEnv.LEASE_S, kv.leaseSeconds),
            (KvEnv.UCX_TCP_PORT_RANGE, f"{kv.tcpPortBase}-{kv.tcpPortBase + KV_TCP_PORTS - 1}"))]
        # the KV responses' remote_host: the pod's IP, known only once the pod is scheduled (downward API)
        env.append({"name": str(KvEnv.POD_IP), "valueFrom": {"fieldRef": {"fieldPath": POD_IP_FIELD}}})
    if (sv := spec.serving) is not None:  # the front's limits (contract.ServingEnv), only when the spec has them
        env += [{"name": str(k), "value": v} for k, v in sv.options().env()]
    return env


def _resources(spec: DwdpGroupSpec) -> dict[str, Any]:
    res = json.loads(json.dumps(spec.resources or {}))
    gpus = str(spec.gpusPerPod)
    res.setdefault("limits", {})["nvidia.com/gpu"] = gpus
    res.setdefault("requests", {})["nvidia.com/gpu"] = gpus  # extended resources: requests == limits
    if spec.imex.mode == "ComputeDomain":
        res["claims"] = [{"name": IMEX_CLAIM}]
    return res


def _probe(path: str, *, period: int, failures: int, initial: int = 0) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": PortName.HTTP}, "periodSeconds": period,
            "failureThreshold": failures, "initialDelaySeconds": initial, "timeoutSeconds": 5}


def worker_pod(*, name: str, ns: str, uid: str, g: int, i: int, attempt: int, spec: DwdpGroupSpec,
               thash: str, avoid_nodes: list[str] | tuple[str, ...] = (), whole: bool = False) -> dict[str, Any]:
    group_sel = {L.NAME: name, L.GROUP: str(g)}
    labels = {**group_sel, L.POD_INDEX: str(i), L.ATTEMPT: str(attempt), L.TEMPLATE_HASH: thash,
              L.GANG: "complete" if whole else "pending", L.SERVING: "true", "app.kubernetes.io/name": "dwdp-worker",
              L.LLMD_ROLE: LLMD_ROLE_PREFILL}
    container = {
        "name": "worker", "image": spec.image, "command": ["dwdp-worker", "pod"],
        "env": (worker_env(name=name, ns=ns, g=g, i=i, attempt=attempt, spec=spec) + _kernel_cache_env(spec)
                + list(spec.template.env)),
        "ports": [{"name": PortName.HTTP, "containerPort": spec.httpPort},
                  {"name": PortName.STORE, "containerPort": spec.storePort}],
        "resources": _resources(spec),
        "startupProbe": _probe("/healthz", period=10, failures=STARTUP_FAILURE_THRESHOLD),
        "livenessProbe": _probe("/healthz", period=10, failures=3),
        "readinessProbe": _probe("/readyz", period=5, failures=2),
        "volumeMounts": ([{"name": v, "mountPath": path} for v, path in SCRATCH] + _kernel_cache_mounts(spec)
                         + list(spec.template.volumeMounts)),
        # no extra capability: CUDA IPC, IMEX channels and pinned host memory need none
        "securityContext": {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "privileged": False, "capabilities": {"drop": ["ALL"]}},
    }
    pod_spec: dict[str, Any] = {
        "hostname": pod_name(name, g, i), "subdomain": rank_service_name(name),
        "restartPolicy": "Never",  # a dead rank restarts its whole group (operator), never alone
        "containers": [container],
        "volumes": ([{"name": v, "emptyDir": {}} for v, _ in SCRATCH] + _kernel_cache_volumes(spec)
                    + list(spec.template.volumes)),
        "securityContext": {"runAsNonRoot": True, "runAsUser": WORKER_UID, "runAsGroup": WORKER_UID,
                            "fsGroup": WORKER_UID, "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,  # workers never call the API server
        "tolerations": list(spec.template.tolerations),
        "nodeSelector": dict(spec.template.nodeSelector),
        "affinity": {
            # the whole group in one NVLink clique (the first pod matches its own selector: free choice)
            "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": group_sel}, "topologyKey": spec.topologyKey}]},
            # one pod of a group per node
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": group_sel}, "topologyKey": "kubernetes.io/hostname"}]},
        },
    }
    if not whole:
        pod_spec["schedulingGates"] = [{"name": L.GANG_GATE}]
    if avoid_nodes:  # after a placement dead end: not the nodes where the last attempt got stuck
        pod_spec["affinity"]["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": sorted(avoid_nodes)}]}]}}
    if spec.imex.mode == "ComputeDomain":
        pod_spec["resourceClaims"] = [{"name": IMEX_CLAIM, "resourceClaimTemplateName": claim_template_name(name)}]
    meta = _meta(pod_name(name, g, i), ns, name, uid, L.WORKER_COMPONENT, labels)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def lift_gate_patch() -> dict[str, Any]:
    """Merge patch: gang complete, scheduling gates removed (allowed on 1.27+; dropped by older servers)."""
    return {"metadata": {"labels": {L.GANG: "complete"}}, "spec": {"schedulingGates": None}}


def role_patch() -> dict[str, Any]:
    """llm-d's role label on a worker pod an older operator created without it."""
    return {"metadata": {"labels": {L.LLMD_ROLE: LLMD_ROLE_PREFILL}}}


def serving_patch(serving: bool) -> dict[str, Any]:
    return {"metadata": {"labels": {L.SERVING: "true" if serving else "false"}}}
