"""Names that cross a process or package boundary: one definition each (docs/ENV_CONTRACT.md).

The operator (``dwdp_operator``), the worker (``dwdp_worker``) and the runtime (``dwdp_runtime``)
import these instead of spelling the strings. Pure Python, stdlib only: the operator image imports
it without torch.

Invariants:
  * ``PodEnvVar`` lists the pod environment the operator sets on every worker pod, in the order the
    operator renders it (``manifests.worker_env``) and the table of docs/ENV_CONTRACT.md lists it.
    ``POD_ENV`` is that order as a tuple. Tests pin the operator's rendered env, the worker's parser
    (``dwdp_worker.launch.envcontract``) and the doc table against it.
  * ``TuningEnv`` lists the other ``DWDP_*`` variables a process reads. They are not part of the pod
    contract: the operator never sets them, and a user may pass them through ``spec.template.env``.
  * Each closed set of values that crosses a boundary (transfer mode, model dtype, memory backend
    choice) is a ``StrEnum``. The pydantic ``Literal`` types the CRD model and the env parser use
    are built from the enum (``_literal_of``), so no value is written twice.
  * A ``StrEnum`` member is a ``str``: ``Transfer.COPY_ENGINE == "copy_engine"``, it formats,
    ``str()``s and JSON-encodes as its value, so code compares members with strings read from the
    environment. Keys written into Kubernetes objects (``Label``, ``PortName``) are plain ``str``
    constants instead, so every serializer (``yaml.safe_dump`` too) sees exact strings; for the
    same reason the operator writes ``str(PodEnvVar.X)`` into a pod's env.

Adding a name: add a member to the right enum, with a comment giving its reason. For a new
pod-contract variable every pod gets, add it to ``PodEnvVar``, render it in ``manifests.worker_env``,
parse it in ``envcontract.PodEnv`` and add a row to docs/ENV_CONTRACT.md; the contract tests fail
until all four agree. A variable only some specs set goes in ``POD_ENV_OPTIONAL`` (see there).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal


def _literal_of(enum: type[StrEnum]) -> Any:
    """``Literal["a", "b", ...]`` of the enum's values (a pydantic field type; JSON schema ``enum``)."""
    return Literal[tuple(m.value for m in enum)]  # type: ignore[valid-type]


class PodEnvVar(StrEnum):
    """The pod environment contract (docs/ENV_CONTRACT.md), in the operator's rendering order."""

    JOB = "DWDP_JOB"                            # DwdpGroup name (namespaces rendezvous keys)
    NAMESPACE = "DWDP_NAMESPACE"
    GROUP = "DWDP_GROUP"                        # group index g
    POD_INDEX = "DWDP_POD_INDEX"                # pod index i inside the group
    RANK_BASE = "DWDP_RANK_BASE"                # first rank of this pod = i × gpusPerPod
    GPUS_PER_POD = "DWDP_GPUS_PER_POD"
    SIZE = "DWDP_SIZE"                          # dwdpSize
    STORE_ADDR = "DWDP_STORE_ADDR"              # rank 0's rendezvous store host
    STORE_PORT = "DWDP_STORE_PORT"
    ATTEMPT = "DWDP_ATTEMPT"                    # group attempt, bumps on every group restart
    TOKEN = "DWDP_TOKEN"                        # group secret, from a Secret (secretKeyRef)
    NUM_EXPERTS = "DWDP_NUM_EXPERTS"
    EXPERTS_PER_WORKER = "DWDP_EXPERTS_PER_WORKER"
    PREFETCH_STRIDE = "DWDP_PREFETCH_STRIDE"
    PREFETCH_SLOTS = "DWDP_PREFETCH_SLOTS"
    CONTENTION_OPT = "DWDP_CONTENTION_OPT"      # "true" / "false"
    TRANSFER = "DWDP_TRANSFER"                  # a ``Transfer`` value
    MODEL = "DWDP_MODEL"                        # checkpoint directory, or empty
    MODEL_SYNTHETIC = "DWDP_MODEL_SYNTHETIC"    # synthetic architecture name, or empty
    DTYPE = "DWDP_DTYPE"                        # a ``ModelDtype`` value
    BACKEND = "DWDP_BACKEND"                    # a ``Backend`` value
    HTTP_PORT = "DWDP_HTTP_PORT"


POD_ENV: tuple[PodEnvVar, ...] = tuple(PodEnvVar)
# exactly one of the two is non-empty; every other contract variable must be present
POD_ENV_ONE_OF: tuple[PodEnvVar, ...] = (PodEnvVar.MODEL, PodEnvVar.MODEL_SYNTHETIC)
# Pod env the operator sets only when a spec feature asks for it (e.g. spec.kvTransfer): define the
# feature's names as a StrEnum in this module and add its members here. They are reserved like
# POD_ENV (refused in spec.template.env); the worker reads them only when present, with the
# feature's own parser (parse_env requires exactly POD_ENV).
class KvEnv(StrEnum):
    """Pod env of the KV handoff (``spec.kvTransfer``; docs/KV_TRANSFER.md), set only when the spec has it."""

    BUDGET_BYTES = "DWDP_KV_BUDGET_BYTES"   # KV region per rank in bytes (absent or 0: KV handoff off)
    BLOCK_BYTES = "DWDP_KV_BLOCK_BYTES"     # allocation unit, a multiple of 64
    TTL_S = "DWDP_KV_TTL_S"                 # seconds unclaimed KV is kept
    LEASE_S = "DWDP_KV_LEASE_S"             # seconds a claimed pull may take
    # UCX's own variable: its TCP transport listens in this range, which the group's NetworkPolicy
    # opens (decode engines reach a rank's NIXL agent there; RDMA and NVLink paths bypass it)
    UCX_TCP_PORT_RANGE = "UCX_TCP_PORT_RANGE"
    # the pod's own IP, from the downward API (``valueFrom.fieldRef: status.podIP``, never a literal): the
    # ``remote_host`` of every KV response, the address a decode engine or router reaches this pod at
    POD_IP = "DWDP_POD_IP"


#: TCP ports a pod's NIXL/UCX agents may listen on, from ``spec.kvTransfer.tcpPortBase`` (each rank's
#: UCX worker listens on one port per interface: 64 covers 8 ranks × several interfaces)
KV_TCP_PORTS = 64


class ServingEnv(StrEnum):
    """Pod env of the HTTP front (``spec.serving``), set only when the spec has it; absent = the
    worker's own defaults (``dwdp-worker pod`` flags). Present, they win over the flags."""

    MAX_QUEUE = "DWDP_MAX_QUEUE"                  # waiting requests before 429 (--max-queue)
    MAX_NUM_TOKENS = "DWDP_MAX_NUM_TOKENS"        # tokens packed into one forward (--max-num-tokens)
    MAX_NUM_SEQS = "DWDP_MAX_NUM_SEQS"            # sequences packed into one forward (--max-num-seqs)
    MAX_NEW_TOKENS = "DWDP_MAX_NEW_TOKENS"        # largest max_tokens served (--max-new-tokens)
    SERVED_MODEL_NAME = "DWDP_SERVED_MODEL_NAME"  # model id in the API (--served-model-name)
    CUDA_GRAPHS = "DWDP_CUDA_GRAPHS"              # prefill shapes replayed from CUDA graphs, 0 = off (--cuda-graphs)
    BATCH_INVARIANT = "DWDP_BATCH_INVARIANT"      # true: batch-invariant dense GEMMs (--batch-invariant)


class LayoutEnv(StrEnum):
    """Pod env of layout knobs whose default keeps today's pods unchanged, set only when not the default."""

    EXPERT_REPLICAS = "DWDP_EXPERT_REPLICAS"      # experts.replicas when > 1 (absent: 1, no spare copy)
    ON_UNCOVERED = "DWDP_ON_UNCOVERED"            # experts.onUncovered when reload (absent: restart, today's pods)


class ElasticEnv(StrEnum):
    """Pod env of an elastic group (``experts.replicas`` > 1 or ``onUncovered: reload``), set only for one."""

    # where every pod of the group answers, with ``{pod}`` for the pod index (``<name>-g<g>-p{pod}.<name>-ranks.
    # <ns>.svc``): a survivor finds the standby store of any rank there when the store host is lost, and a
    # replacement pod finds the group's current store (``standby_store_port``; dwdp_runtime.elastic.store_chain)
    POD_ADDR_TEMPLATE = "DWDP_POD_ADDR_TEMPLATE"


#: ``ElasticEnv.POD_ADDR_TEMPLATE``'s stand-in for the pod index: the operator writes it, the worker fills it in
#: (``str.format(pod=i)``: ``dwdp_runtime.elastic.store_chain.rank_host``)
POD_PLACEHOLDER = "{pod}"


def standby_store_port(store_port: int, rank: int) -> int:
    """The port rank ``rank`` of an elastic group listens on with its standby store (the store the survivors move
    to when the store host is lost): ``store_port + 1 + rank``, so every rank of a group has its own port on one
    host (the local launcher) and the NetworkPolicy opens one range ``[store_port, store_port + dwdpSize]``."""
    return store_port + 1 + rank


POD_ENV_OPTIONAL: tuple[str, ...] = (tuple(v.value for v in KvEnv) + tuple(v.value for v in ServingEnv)
                                     + tuple(v.value for v in LayoutEnv) + tuple(v.value for v in ElasticEnv))
RESERVED_POD_ENV: frozenset[str] = frozenset(v.value for v in POD_ENV) | frozenset(POD_ENV_OPTIONAL)


class TuningEnv(StrEnum):
    """``DWDP_*`` variables outside the pod contract: a user sets them (``spec.template.env``, or the environment of
    a local launch); the operator sets one only, ``COMPILE_CACHE_DIR``, where ``spec.kernelCache`` asks for it."""

    SM_GATHER_CTAS = "DWDP_SM_GATHER_CTAS"      # grid of transfer sm_gather (dwdp_runtime.sm_gather)
    LOG_LEVEL = "DWDP_LOG_LEVEL"                # rank processes' log level (default WARNING)
    TEST_COPY_DELAY_S = "DWDP_TEST_COPY_DELAY_S"  # fault-injection test hook: slow copy thread
    FP8_BACKEND = "DWDP_FP8_BACKEND"            # FP8 experts kernels on CUDA: auto | triton | cute (kernels.fp8_moe)
    FP8_DENSE = "DWDP_FP8_DENSE"                # FP8 checkpoints' dense linears kept e4m3: off | on (checkpoint.fp8_dense)
    FP4_KERNEL = "DWDP_FP4_KERNEL"              # FP4 experts on CUDA: auto | weight-only | w4a8 (kernels.w4a8_moe)
    W4A8_OVERLAP = "DWDP_W4A8_OVERLAP"          # W4A8 re-encoding one chunk ahead on a side stream: off | on
    # the KV responses' remote_host, when neither the bound address nor the pod IP is what a decode engine
    # reaches (a NAT, a node port, a DNS name): --kv-advertise-host; a user sets it through spec.template.env
    KV_ADVERTISE_HOST = "DWDP_KV_ADVERTISE_HOST"
    KV_REGION_MEMORY = "DWDP_KV_REGION_MEMORY"  # how a CUDA rank allocates its KV region (kv.region.RegionMemory)
    COMPILE_CACHE_DIR = "DWDP_COMPILE_CACHE_DIR"  # kernel compile caches kept across starts (dwdp_runtime.compile_cache)
    RANK_START = "DWDP_RANK_START"              # how the front starts rank processes: forkserver | spawn (RankStart)


def tuning_choice(var: TuningEnv, choices: type[StrEnum], default: StrEnum, environ=None) -> Any:
    """The member of ``choices`` that tuning variable ``var`` names (``default`` when unset or empty, case and
    surrounding blanks ignored); an unknown value is a ``ValueError`` naming the accepted ones."""
    import os

    raw = (os.environ if environ is None else environ).get(var, "").strip().lower() or default.value
    try:
        return choices(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r}: expected one of {', '.join(m.value for m in choices)}") from None


class Fp4Kernel(StrEnum):
    """``DWDP_FP4_KERNEL``: how FP4 experts run on CUDA (``kernels.w4a8_moe``; ``dwdp plan --fp4-kernel``)."""

    AUTO = "auto"                # W4A8 where it can run, else weight-only (the default)
    WEIGHT_ONLY = "weight-only"  # the FP4 Triton kernels: the dequantized model's numbers exactly
    W4A8 = "w4a8"                # re-encoded to e4m3 blocks, the FP8 kernels (refused where it cannot run)


FP4_KERNELS: tuple[str, ...] = tuple(m.value for m in Fp4Kernel)


class RankStart(StrEnum):
    """``DWDP_RANK_START``: how the front starts its rank processes (``front.rank_handle.rank_context``)."""

    FORKSERVER = "forkserver"  # forked from one process that imported torch and `transformers` once (the default)
    SPAWN = "spawn"            # a fresh interpreter per rank: every rank imports everything itself


class Switch(StrEnum):
    """An ``off | on`` tuning variable (``DWDP_FP8_DENSE``, ``DWDP_W4A8_OVERLAP``)."""

    OFF = "off"
    ON = "on"


class Transfer(StrEnum):
    """How a rank submits one layer's peer copies (``dwdp_runtime.cuda_streams``)."""

    COPY_ENGINE = "copy_engine"  # one cuMemcpyAsync per entry on the copy stream (default)
    BATCHED = "batched"          # one cuMemcpyBatchAsync per layer (CUDA 13 driver)
    SM_GATHER = "sm_gather"      # SM kernel gathering 16-byte lines (opt-in; taxes compute SMs)


TransferMode = _literal_of(Transfer)
TRANSFER_MODES: tuple[str, ...] = tuple(m.value for m in Transfer)
DEFAULT_TRANSFER: str = Transfer.COPY_ENGINE.value  # a plain str: safe in dataclass dumps


class OnUncovered(StrEnum):
    """``--on-uncovered`` / ``experts.onUncovered``: what a group does when a rank loss leaves some expert with no
    surviving holder (r = 1, or r ranks lost; ``DwdpManager.reload_uncovered``)."""

    RESTART = "restart"  # the group restarts (today's behaviour; the default: no memory or checkpoint read at run time)
    RELOAD = "reload"    # every survivor reads those experts from the checkpoint into private memory and serves on


OnUncoveredName = _literal_of(OnUncovered)
ON_UNCOVERED_POLICIES: tuple[str, ...] = tuple(m.value for m in OnUncovered)
DEFAULT_ON_UNCOVERED: str = OnUncovered.RESTART.value


class ModelDtype(StrEnum):
    """``spec.model.dtype`` / ``DWDP_DTYPE``: the dtype the worker loads weights in."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"


ModelDtypeName = _literal_of(ModelDtype)


class Backend(StrEnum):
    """``DWDP_BACKEND`` / ``--backend``: the memory backend a worker asks for."""

    AUTO = "auto"  # fabric with an IMEX channel, else posix_fd with CUDA, else host
    HOST = "host"  # memfd + mmap, CPU tensors (tests, CPU-only machines)
    CUDA = "cuda"  # cuMem* with the best handle type the device supports


BackendName = _literal_of(Backend)


class PortName:
    """Container port names: Services' ``targetPort`` and the probes refer to them by name."""

    HTTP = "http"    # API, /healthz, /readyz, /metrics (spec.httpPort)
    STORE = "store"  # rank 0's TCPStore (spec.storePort), reachable only from the group's pods


DEFAULT_HTTP_PORT = 8000    # spec.httpPort default
#: ``--max-new-tokens`` / ``spec.serving.maxNewTokens`` default: this is a context server — the first token is
#: its product, a few more are a convenience (decoded with the KV cache); long generations belong to a decode
#: engine, reached through ``kv_transfer_params`` (docs/KV_TRANSFER.md)
DEFAULT_MAX_NEW_TOKENS = 512
#: ``spec.serving.cudaGraphs`` bound (the CRD's maximum too): every captured prefill shape keeps its activations'
#: memory pool on the GPU, and a server bucketing its batches needs a handful; 64 is past any sane count
MAX_CUDA_GRAPHS = 64
#: ``spec.serving.cudaGraphs`` / ``--cuda-graphs`` when unset, on GPU ranks that can replay graphs: measured on one
#: H100 (2026-12-06, bench/host_gap.py) an eager prefill waits on the host for 23 % of its wall time at 16K tokens
#: and 66-86 % at 1K-4K, which a replay removes. 32 shapes hold the single-sequence ladder from 1K to 16K tokens
#: (graph_buckets: 33 shapes); the graphs share one memory pool, so more cost capture time (a forward each), not
#: memory
DEFAULT_CUDA_GRAPHS = 32
DEFAULT_STORE_PORT = 29500  # spec.storePort default (torch.distributed's customary store port)

TOKEN_SECRET_KEY = "token"  # key of the group token in Secret <name>-token (DWDP_TOKEN's secretKeyRef)

LABEL_PREFIX = "dwdp.io"


class Label:
    """Label keys on the operator's children (one place, so selectors never drift)."""

    NAME = f"{LABEL_PREFIX}/name"                    # the DwdpGroup name
    GROUP = f"{LABEL_PREFIX}/group"                  # group index g
    POD_INDEX = f"{LABEL_PREFIX}/pod-index"          # pod index i inside the group
    ATTEMPT = f"{LABEL_PREFIX}/attempt"              # group attempt; bumps on every restart or rollout
    TEMPLATE_HASH = f"{LABEL_PREFIX}/template-hash"
    GANG = f"{LABEL_PREFIX}/gang"                    # "pending" until every pod exists, then "complete"
    SERVING = f"{LABEL_PREFIX}/serving"              # "true" = behind the client Service; "false" while draining
    MANAGED_BY = "app.kubernetes.io/managed-by"
    COMPONENT = "app.kubernetes.io/component"
    LLMD_ROLE = "llm-d.ai/role"                      # llm-d's serving role; DWDP workers are "prefill"


LLMD_ROLE_PREFILL = "prefill"  # every DWDP worker serves the context (prefill) phase


GANG_GATE = f"{LABEL_PREFIX}/gang"  # scheduling gate name, lifted once the gang is complete
