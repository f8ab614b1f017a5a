"""Engine: one rank's MoE model + its DWDP manager; one packed prefill forward per call.

Build (``Engine.build``):
  1. read config.json; ``config.num_experts`` must equal the model's routed expert count (ValueError otherwise);
  2. ``DwdpManager.create`` (memory backend, copy stream) on the rank's device;
  3. ``loader.load_sharded``: meta model → dense weights → this rank's experts into transport handles →
     ``manager.setup()`` (handle exchange with progress bars) → experts bound to composites;
  4. ``model.attach``, the one owner of every change to the model: the DWDP hooks (start_forward /
     wait_and_bind / finish_layer around every experts module), the quantization's experts forwards, and the
     experts implementation — ``auto`` runs DWDP's Triton kernels on CUDA (they read the bound composites as
     they are; plus the fused RMSNorm/RoPE of ``layers_impl``) and keeps `transformers`' own on CPU (bitwise
     with the oracle).

Forward (``Engine.forward(sequences)``): validate → pack into one row (``packing``) → model forward without KV
cache → last-position logits of each sequence, float32 on CPU. Built with ``cuda_graphs=N`` (CUDA only), plain
prefill forwards of up to N batch shapes replay from CUDA graphs (``prefill_graphs``: the first forward of a
shape eager, the second captured, then replayed; the same logits). Timings per forward:
  * ``compute_s``        — wall time of the whole forward (device synchronised at the end);
  * ``prefetch_wait_s``  — host time blocked in ``wait_and_bind`` (host backend: waiting on the copy thread;
                           CUDA: the wait is a stream wait, so the host-side figure is ~0 and the exposed
                           wait shows up in ``compute_s`` instead);
  * ``restarts``         — the prefetch schedule's restart count so far.

Invariants: an engine takes token ids only (no tokenizer: the front tokenizes). ``close()`` is idempotent,
closes the attachment (every change to the model undone), releases the manager and points expert parameters
back to meta (a forward after close
raises RuntimeError instead of reading unmapped memory). ``forward`` is serialised by a lock (the model and
the prefetch schedule are single-stream state).

Cache path (``Engine.generate``, ``generation.py``): packed prefill with the model's KV cache, greedy decode
for ``max_new_tokens > 1``, and — when built with a KV budget (``kv=KvSettings(...)``) — each requested
sequence's K/V kept in the rank's NIXL-registered KV region for a decode engine to pull (docs/KV_TRANSFER.md).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..checkpoint.loader import load_config, load_sharded, read_config_json, unbind_experts
from ..model import registry as arch
from ..model.attach import attach
from .generation import check_requests, generate_batch
from ..model.packing import packed_logits, packed_scored_logits, validate
from .prefill_graphs import PrefillGraphs, check_max_graphs
from .protocol import RankStats
from .startup import StartupTimes

log = logging.getLogger(__name__)


@dataclass
class ForwardResult:
    logits: Any             # torch.Tensor [num_sequences, vocab] float32 on CPU: last-position logits
    compute_s: float        # wall time of the forward
    prefetch_wait_s: float  # exposed prefetch wait (host backend: time blocked on copies)
    restarts: int           # the prefetch schedule's restart count so far
    prompt_logits: list | None = None  # with ``score``: [len-1, vocab] per flagged sequence, else None


@dataclass
class GenerateResult:
    outputs: list           # generation.SequenceOutput per sequence
    compute_s: float
    prefetch_wait_s: float
    restarts: int


def num_experts_of(model_dir) -> int:
    """The routed expert count of the checkpoint in ``model_dir``: what config.json states under a usual key,
    else what discovery finds in the model its config builds (meta device)."""
    hint = arch.expert_count_hint(read_config_json(model_dir))
    return hint if hint is not None else arch.num_experts_in_config(load_config(model_dir))


class Engine:
    def __init__(self, *, model, manager, attachment, hf_config, model_dir, load_report=None, kv=None, graphs=None,
                 startup: StartupTimes = StartupTimes()):
        self.model, self.manager, self.attachment = model, manager, attachment
        self.startup = startup  # this build's phases (rank.startup); process._serve adds import/rendezvous/warm-up
        self.graphs = graphs  # prefill_graphs.PrefillGraphs, or None (eager only)
        self.kv = kv  # kv.service.KvService, or None (no KV budget)
        self.hf_config = hf_config
        self.model_dir = model_dir
        self.load_report = load_report
        text_config = hf_config.get_text_config()  # a vision-language model keeps its vocabulary there
        self.vocab_size: int = int(text_config.vocab_size)
        self.max_positions: int = int(getattr(text_config, "max_position_embeddings", 1 << 30))
        self.device = manager.device
        self._lock = threading.Lock()
        self._closed = False
        self._forwards = 0
        self._last_forward_s = 0.0
        self._tokens = 0

    @classmethod
    def build(cls, *, model_dir, config, rank: int, rendezvous, backend: str = "auto", device=None,
              token: str = "", dtype: str | None = None, progress: bool = True,
              copy_delay_s: float = 0.0, experts: str = "auto", kv=None, identity=None,
              cuda_graphs: int = 0, batch_invariant: bool = False, fused_router: bool = False,
              incarnation: str | None = None, join=None) -> "Engine":
        """``kv``: ``kv.service.KvSettings`` (a budget > 0 starts the KV service); ``identity``: its ``RankIdentity``;
        ``cuda_graphs``: how many prefill batch shapes may be captured in CUDA graphs (0: none; a CUDA device only);
        ``batch_invariant``: dense GEMMs through ``kernels.batch_invariant`` (a CUDA device only; process-wide,
        undone by ``close``); ``fused_router``: the router modules run ``kernels.router`` (``model.router_impl``);
        ``incarnation``: this process's id in an elastic group's membership; ``join``: the running group a replacement
        joins (``dwdp_runtime.elastic.entry.JoinPoint``: the members' memory is imported from their records)."""
        from dwdp_runtime.manager import DwdpManager

        check_max_graphs(cuda_graphs, "cuda_graphs")  # before minutes of loading
        t_config = time.monotonic()
        hf_config = load_config(model_dir)
        n = arch.num_experts_in_config(hf_config)
        if config.num_experts != n:
            raise ValueError(f"DWDP config num_experts={config.num_experts} but the model in {model_dir} has {n} "
                             f"routed experts per layer; set num_experts={n} (and experts-per-worker/stride to match)")
        t0 = time.monotonic()
        manager = DwdpManager.create(config=config, rank=rank, rendezvous=rendezvous, backend=backend,
                                     device=device, token=token, progress=progress, copy_delay_s=copy_delay_s,
                                     incarnation=incarnation)
        try:
            if join is not None:
                manager.prepare_join(join)
            _set_cuda_device(manager.device)
            t1 = time.monotonic()
            loaded = load_sharded(model_dir, manager, dtype=dtype, progress=progress, config=hf_config)
            t2 = time.monotonic()
            attachment = attach(loaded.model, device=manager.device, experts=experts, manager=manager,
                                overrides=loaded.overrides, batch_invariant=batch_invariant,
                                fused_router=fused_router)
            t3 = time.monotonic()
            graphs = _graphs(loaded.model, manager, cuda_graphs)
            t4 = time.monotonic()
            kv_service = _start_kv(kv, manager.device, identity, rank)
            t5 = time.monotonic()
        except BaseException:
            manager.release(barrier=False)
            raise
        rep = loaded.report
        startup = StartupTimes(manager_s=t1 - t0, model_s=(t0 - t_config) + rep.model_s, read_s=rep.read_s, map_s=rep.map_s, attach_s=t3 - t2,
                               graphs_s=t4 - t3, kv_s=t5 - t4, read_bytes=rep.dense_bytes + rep.local_expert_bytes)
        return cls(model=loaded.model, manager=manager, attachment=attachment, hf_config=hf_config,
                   model_dir=model_dir, load_report=loaded.report, kv=kv_service, graphs=graphs, startup=startup)

    # -- run ------------------------------------------------------------------------------------------------
    def _bind_wait_s(self) -> float:
        return self.manager.bind_wait_s

    def forward(self, sequences: list[list[int]], score: list[bool] | None = None) -> ForwardResult:
        """One packed forward (no KV cache). Raises ``packing.BadBatchError`` (a ValueError) for bad input.
        ``score``: per sequence, also return the logits of every prompt position (prompt scoring)."""
        sequences = validate(sequences, vocab_size=self.vocab_size, max_positions=self.max_positions)
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            wait0 = self._bind_wait_s()
            t0 = time.perf_counter()
            if score and any(score):  # .cpu() synchronises the device
                logits, prompt_logits = packed_scored_logits(self.model, sequences, self.device, score)
            elif self.graphs is not None:
                logits, prompt_logits = self.graphs.logits(sequences), None
            else:
                logits, prompt_logits = packed_logits(self.model, sequences, self.device), None
            elapsed = time.perf_counter() - t0
            self._forwards += 1
            self._tokens += sum(len(s) for s in sequences)
            self._last_forward_s = elapsed
            return ForwardResult(logits=logits, compute_s=elapsed, prefetch_wait_s=self._bind_wait_s() - wait0,
                                 restarts=self.manager.num_restarts, prompt_logits=prompt_logits)

    def generate(self, sequences: list[list[int]], *, max_new_tokens=None, keep_kv=None,
                 model_name: str = "", decode_budget_s: float | None = None) -> GenerateResult:
        """Packed prefill with the KV cache; per sequence ``max_new_tokens`` greedy tokens and, for a request id
        in ``keep_kv``, its KV kept for a remote decode. Raises ``BadBatchError`` (ValueError) for bad input."""
        sequences = validate(sequences, vocab_size=self.vocab_size, max_positions=self.max_positions)
        max_new, keep = check_requests(sequences, max_new_tokens, keep_kv, max_positions=self.max_positions,
                                       kv_enabled=self.kv is not None)
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is closed")
            wait0 = self._bind_wait_s()
            t0 = time.perf_counter()
            outputs = generate_batch(self.model, self.device, sequences, max_new, keep, self.kv,
                                     model_name=model_name, decode_budget_s=decode_budget_s)
            elapsed = time.perf_counter() - t0
            decoded = sum(len(o.tokens) - 1 for o in outputs)
            self._forwards += 1 + decoded
            self._tokens += sum(len(s) for s in sequences) + decoded
            self._last_forward_s = elapsed
            return GenerateResult(outputs=outputs, compute_s=elapsed, prefetch_wait_s=self._bind_wait_s() - wait0,
                                  restarts=self.manager.num_restarts)

    def stats(self) -> RankStats:
        """The one stats record of this rank (``protocol.RankStats``): what its heartbeats carry to the front,
        which ``/healthz`` and ``/metrics`` show."""
        m = self.manager.stats() if not self._closed else {"restarts": self.manager.num_restarts,
                                                           "backend": self.manager.backend_name}
        return RankStats(forwards=self._forwards, tokens=self._tokens, prefetch_restarts=int(m.get("restarts", 0)),
                         prefetch_bytes=int(m.get("prefetch_bytes", 0)),
                         remote_bytes_per_forward=int(m.get("remote_bytes_per_forward", 0)),
                         last_forward_s=self._last_forward_s, backend=m.get("backend"),
                         kv=self.kv.stats() if self.kv is not None else None,
                         graphs=dataclasses.replace(self.graphs.counters) if self.graphs is not None else None)

    # -- teardown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.attachment.close()
            if self.graphs is not None:
                self.graphs.close()  # their copy nodes read peers' memory the manager is about to unmap
            if self.kv is not None:
                self.kv.close()  # deregister the KV region before the process may unmap anything
            try:
                self.manager.release()
            finally:
                unbind_experts(self.model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _graphs(model, manager, cuda_graphs: int):
    if cuda_graphs == 0:
        return None
    return PrefillGraphs(model, manager.device, max_graphs=cuda_graphs, manager=manager)  # refuses a CPU device


def _start_kv(settings, device, identity, rank):
    if settings is None or not settings.enabled:
        return None
    from ..kv.service import KvService, RankIdentity

    return KvService.start(settings, device=device, identity=identity or RankIdentity(rank=rank))


def _set_cuda_device(device) -> None:
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
