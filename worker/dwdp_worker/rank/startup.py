"""``StartupTimes``: where a rank's time to ready goes, measured once per start (issue #34, cold start).

Phases, in the order a rank runs them (``process._serve`` and ``Engine.build``):
  * ``import_s``      importing torch and the runtime (the interpreter's own start is before it);
  * ``rendezvous_s``  waiting for the group's other ranks (the slowest rank's start shows here);
  * ``manager_s``     ``DwdpManager.create``: backend probe, CUDA context, copy streams;
  * ``model_s``       the config and the meta model: `transformers`' modeling module imported (seconds on a
                      busy host: it imports most of `transformers`), modules built on the meta device; then
                      the checkpoint's names: headers parsed, `transformers`' conversion rules matched;
  * ``read_s``        the checkpoint read: dense weights and local experts into their memory, the local
                      handles' allocation included (``cuMemCreate`` per expert weight: it cannot be separated
                      from the fill it feeds); ``read_bytes`` of them;
  * ``map_s``         ``manager.setup``: peer handles exchanged (POSIX fd / fabric) and composites mapped
                      (``cuMemMap`` / ``cuMemSetAccess``) — the CUDA registration;
  * ``attach_s``      experts implementation, fused layers, DWDP hooks, ``--batch-invariant``;
  * ``kv_s``          the KV service: NIXL agent and the region's registration (0 without a KV budget);
  * ``graphs_s``      CUDA-graph bookkeeping (capture itself runs at a shape's second forward, not at start);
  * ``warmup_s``      the first forward: Triton compiles (or loads from the compile cache) every kernel it
                      meets, cuDNN/cuBLAS pick their kernels; on CPU just a forward;
  * ``cache_files_before`` / ``_after``: files in the compile caches (``dwdp_runtime.compile_cache``) around
                      the start: a start that compiled nothing leaves them equal.

On the wire it is one ``LoadProgress("startup", text)`` line of ``key=value`` pairs (``describe`` /
``parse`` round-trip), so the front's log carries it and ``bench/cold_start.py`` reads it from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: the LoadProgress step name of the line
STEP = "startup"


@dataclass(frozen=True)
class StartupTimes:
    import_s: float = 0.0
    rendezvous_s: float = 0.0
    manager_s: float = 0.0
    model_s: float = 0.0
    read_s: float = 0.0
    map_s: float = 0.0
    attach_s: float = 0.0
    kv_s: float = 0.0
    graphs_s: float = 0.0
    warmup_s: float = 0.0
    read_bytes: int = 0
    cache_files_before: int = 0
    cache_files_after: int = 0

    @property
    def total_s(self) -> float:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self) if f.name.endswith("_s"))

    @property
    def read_gb_s(self) -> float:
        return self.read_bytes / self.read_s / 1e9 if self.read_s > 0 else 0.0

    def describe(self) -> str:
        """``import_s=0.812 rendezvous_s=… read_bytes=… cache_files_after=…`` (``parse`` reads it back)."""
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            parts.append(f"{f.name}={v:.3f}" if isinstance(v, float) else f"{f.name}={v}")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str) -> "StartupTimes":
        """The inverse of ``describe`` (unknown keys are refused: a renamed field must not read as zero)."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for part in text.split():
            key, _, raw = part.partition("=")
            if key not in types:
                raise ValueError(f"startup line: unknown field {key!r} in {text!r}")
            values[key] = int(raw) if types[key] in (int, "int") else float(raw)
        return cls(**values)
