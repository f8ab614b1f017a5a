"""The rank protocol: the one definition of what a rank process and its front say to each other.

A rank process (``rank_process``) and the front's handle of it (``rank_handle``) exchange these
dataclasses over one duplex ``multiprocessing`` ``Connection`` (pickled; ``spawn`` re-imports this
module in the child, so both sides decode the same types)::

    front → rank:  Forward(batch_id, sequences, top_n, score,   one step of each packed sequence; ``score``
                           max_new_tokens, keep_kv)        flags the sequences whose prompt is also scored;
                                                           with the KV cache: several tokens, KV kept
                   Stop()                                leave the group and exit 0
    rank  → front: PhaseChanged(phase)                   starting → rendezvous → loading → warmup
                   LoadProgress(...)                     what the load has done so far (logged at info)
                   Ready(info)                           vocab size, context length, pid, stats
                   Heartbeat(stats)                      every ``timeouts.RANK_HEARTBEAT_S``, busy or idle
                   StepResult(batch_id, …)               per sequence: next id, its logprob, top-N (and
                                                         the prompt's scores for flagged sequences;
                                                         continuations, KV transfer params)
                   StepFailed(batch_id, message)         the forward raised; the rank keeps serving
                   PeerLost(message)                     the group is broken; the rank exits 1 next
                   MembershipChanged(epoch, alive, …)    an elastic group's new epoch, applied (issue #30)
                   ExpertsReloaded(…) / StoreMoved(…)    experts read back / the store moved to a standby
                   Fatal(message)                        start-up or serving failed; the process exits 1

Invariants:
  * Every message is one of the classes below (``RankMessage`` / ``FrontMessage``): no tuple, no
    string tag; a receiver dispatches on the type.
  * ``RankSpec`` is everything a rank needs to start (built by ``launcher`` / ``pod``), picklable.
  * Ranks never see text: sequences are token ids, results are ids and float log-probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from . import timeouts
from .scoring import PromptScores
from ..kv.service import KvSettings
from ..kv.store import KvStats
from .prefill_graphs import GraphCounters


@dataclass(frozen=True, kw_only=True)
class RankSpec:
    """Everything a rank process needs (picklable; built by the launcher or the pod entrypoint)."""

    model_dir: str
    config: dict                     # DwdpConfig.to_dict()
    rank: int                        # DWDP rank inside the group
    group: int
    global_id: int                   # index of this rank in the front (stable, 0..n-1)
    store_host: str
    store_port: int
    job: str = "dwdp"
    attempt: int = 0
    token: str = ""
    backend: str = "auto"
    device: str | None = None        # "cuda:i" or None (host)
    dtype: str | None = None
    threads: int = 1
    rendezvous_timeout_s: float = timeouts.RENDEZVOUS_LOCAL_S
    warmup_tokens: tuple[int, ...] = (0, 1, 2, 3)
    peer_interval_s: float = timeouts.PEER_HEARTBEAT_S
    peer_dead_after_s: float = timeouts.PEER_DEAD_AFTER_S
    log_level: str = "WARNING"       # the front's level: load progress reaches the log at info
    kv: KvSettings = field(default_factory=KvSettings)  # KV handoff (docs/KV_TRANSFER.md); budget 0 = off
    cuda_graphs: int = 0             # prefill batch shapes replayed from CUDA graphs (prefill_graphs); 0 = off
    batch_invariant: bool = False    # dense GEMMs through kernels.batch_invariant (CUDA ranks only)
    # an elastic group's store chain (dwdp_runtime.elastic.store_chain): where every rank's standby store answers
    pod_addr_template: str | None = None   # None: every rank at store_host (local launcher, one pod per group)
    gpus_per_pod: int = 1
    env: dict = field(default_factory=dict)


class RankPhase(StrEnum):
    """Where a rank process is in its life, as the front last heard it."""

    SPAWNED = "spawned"          # the process was started; it has not spoken yet
    STARTING = "starting"        # importing torch, reading the config
    RENDEZVOUS = "rendezvous"    # waiting for the group's other ranks
    LOADING = "loading"          # weights: dense, local experts, handle exchange, composites
    WARMUP = "warmup"            # the first forward
    JOINING = "joining"          # a replacement, loaded and warm, waiting for the running group to admit it
    READY = "ready"              # serving
    UNREACHABLE = "unreachable"  # the front could not write to its pipe


@dataclass(frozen=True)
class RankStats:
    """The engine counters a rank reports with every heartbeat and result (``Engine.stats``)."""

    forwards: int = 0
    tokens: int = 0
    prefetch_restarts: int = 0
    prefetch_bytes: int = 0
    remote_bytes_per_forward: int = 0
    last_forward_s: float = 0.0
    backend: str | None = None
    kv: KvStats | None = None    # the rank's KV store counters (None without a KV budget)
    graphs: GraphCounters | None = None  # prefill from CUDA graphs (None: --cuda-graphs 0)
    error: str | None = None     # stats could not be read (never takes the rank down)


@dataclass(frozen=True)
class RankInfo:
    vocab_size: int
    max_positions: int
    pid: int
    stats: RankStats


# -- front → rank -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Forward:
    batch_id: int
    sequences: list[list[int]]
    top_n: int
    score: list[bool] | None = None  # per sequence: also the logprob of every prompt token (echo + logprobs)
    # per sequence, with the KV cache (``Engine.generate``): greedy tokens this step makes, and the request
    # id to keep its KV under for a remote decode (None: don't). Both None: one forward without a cache.
    max_new_tokens: list[int] | None = None
    keep_kv: list[str | None] | None = None


@dataclass(frozen=True)
class Stop:
    pass


FrontMessage = Forward | Stop


# -- rank → front -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PhaseChanged:
    phase: RankPhase


@dataclass(frozen=True)
class LoadProgress:
    """One line of load progress (the front logs it at info, prefixed with the rank)."""

    step: str                 # "rendezvous" | "weights" | "ready" …: what finished
    detail: str               # human-readable figures (layers, bytes, handles, seconds)


@dataclass(frozen=True)
class Ready:
    info: RankInfo


@dataclass(frozen=True)
class Heartbeat:
    stats: RankStats
    busy: bool = False        # sent from inside a forward (the heartbeat thread beats through it)


@dataclass(frozen=True)
class Continuation:
    """Tokens a rank decoded with the KV cache after a sequence's first token of this step."""

    ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass(frozen=True)
class KvKept:
    """A sequence's KV handoff outcome: the transfer params (JSON-ready dict), or why it was not kept."""

    params: dict | None = None
    error: str | None = None     # the KV budget is full (the front answers 429)


@dataclass(frozen=True)
class StepResult:
    batch_id: int
    next_ids: list[int]                          # greedy token per sequence
    logprobs: list[float]                        # its log-probability
    top: list[list[tuple[int, float]]]           # top-N (id, logprob) per sequence
    compute_s: float
    prefetch_wait_s: float
    forward_s: float
    stats: RankStats
    prompt: list[PromptScores | None] | None = None  # per sequence, when Forward.score flagged it
    continuations: list[Continuation | None] | None = None   # per sequence, when Forward.max_new_tokens
    kv: list[KvKept | None] | None = None                    # per sequence, when Forward.keep_kv


@dataclass(frozen=True)
class StepFailed:
    batch_id: int
    message: str


@dataclass(frozen=True)
class PeerLost:
    message: str


@dataclass(frozen=True)
class Fatal:
    message: str


@dataclass(frozen=True)
class MembershipChanged:
    """An elastic group moved to a new membership epoch and this rank re-planned its copies (issue #30)."""

    epoch: int
    alive: tuple[int, ...]   # DWDP ranks of the group still serving
    replan_s: float          # seconds the re-plan took on this rank (between two forwards)
    joined: tuple[int, ...] = ()     # ranks whose replacement this rank admitted into its plan at this epoch
    unreadable: tuple[int, ...] = ()  # joined ranks whose memory this rank could not import (planned without)


@dataclass(frozen=True)
class StoreMoved:
    """The group's store host was lost and the survivors moved its store to a standby (issue #30)."""

    generation: int
    lost_host: int           # the DWDP rank that hosted the lost store
    new_host: int            # the DWDP rank whose standby store the group uses now
    seconds: float           # from the verdict to the new store in use, on this rank


@dataclass(frozen=True)
class ExpertsReloaded:
    """At a membership epoch this rank read experts no survivor held from the checkpoint (on_uncovered=reload)."""

    epoch: int
    experts: tuple[int, ...]
    bytes_read: int | None   # from the checkpoint files (None: the reader does not count)
    allocated_bytes: int     # memory the reloaded experts take on this rank
    seconds: float


RankMessage = (PhaseChanged | LoadProgress | Ready | Heartbeat | StepResult | StepFailed | PeerLost | Fatal
               | MembershipChanged | ExpertsReloaded | StoreMoved)
