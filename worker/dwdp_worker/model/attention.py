"""How a DWDP forward's attention is dispatched: two answers given through `transformers`' own registries.

1. **The causal SDPA mask inside a CUDA-graph capture** (``one_sequence``).

`transformers` (5.17, the GPU machines') builds no mask for a plain causal forward — one sequence, no padding,
no cache — and lets SDPA run its causal kernel (``is_causal=True``). Inside a stream capture it decides
otherwise twice, because ``is_tracing`` counts a capture as tracing (for the sake of ``torch.export``):
``find_packed_sequence_indices`` cannot test the positions on the host, so it reports packing (which forbids
the skip), and ``_ignore_causal_mask_sdpa`` refuses the skip itself. The captured forward then ran a dense-mask
attention kernel where the eager one ran the causal kernel: different bits and slower (measured on H200,
2026-12-02: max |Δ logit| 0.06–0.12 between a replay and the eager forward, first at layer 0's attention
output). For a graph captured per exact shape of ONE sequence both answers are known: not packed, causal.

``one_sequence()`` (entered by ``prefill_graphs`` around the capture of a one-sequence shape, and only
there) answers both, through `transformers`' own lookups: ``find_packed_sequence_indices`` says "not packed"
(what its host test says of one sequence), and the ``sdpa`` entry of the mask registry
(``ALL_MASK_ATTENTION_FUNCTIONS``, its documented extension point) returns no mask exactly where
`transformers` skips the mask outside a capture — causal mask function, no padding mask, no sliding window,
query length equal to the key length, no query offset, skipping allowed — and defers to the original
otherwise. Both are restored on exit.

2. **Per-sequence attention for ``--batch-invariant``** (``install_per_sequence``).

Why: a sequence alone gets SDPA's causal kernel (`transformers` builds no mask: ``is_causal=True``); packed
with others it gets the block-diagonal mask and SDPA's masked kernel — another kernel, another summation
order, other bits (H200, 2026-12-04: qwen3_moe |Δ logit| 0.031, mixtral 0.035, first divergence at layer 0's
``o_proj`` input, i.e. the attention output; the dense GEMMs were already ``bi_matmul``). Batch-invariant
GEMMs alone therefore cannot make a packed sequence bitwise its alone self.

What: ``install_per_sequence(model)`` wraps the attention function the model dispatches to (`transformers`'
``ALL_ATTENTION_FUNCTIONS`` entry of ``config._attn_implementation``: ``sdpa``, or ``eager`` through the
modeling module's own ``eager_attention_forward``) and adds a forward pre-hook on the model that reads the
forward's ``position_ids``. When they announce several sequences (``segments``: a restart where a position
is not its predecessor + 1, `transformers`' own packing rule), the wrapper calls the inner function once per
sequence on that sequence's slices of q/k/v, with the mask that sequence would get alone
(``alone_mask``: none for SDPA's causal skip, else the packed mask's diagonal block, which holds the same
values), and concatenates the outputs along the sequence axis. One sequence (or no ``position_ids``) calls
the inner function unchanged.

Invariants: the per-sequence call is the alone call with the same shapes, values and mask; undo
(``PerSequence.close``) restores the registry entry and removes the hooks; installs are reference counted per
implementation (the registry entry is process-wide).

Cost: finding the sequences reads the positions on the host (one sync per forward) — so this cannot run
inside a CUDA-graph capture (``launch.group.check_batch_invariant`` refuses ``--cuda-graphs`` with it), and
one SDPA launch per sequence per layer replaces one per layer.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

MASK_KEY = "sdpa"  # the attention implementation whose mask is wrapped (the engine's models run SDPA)


def causal_skip(kwargs: dict[str, Any], causal_mask_function: Callable) -> bool:
    """Whether `transformers` would build no mask for this call outside a capture (pure)."""
    return (kwargs.get("allow_is_causal_skip", True)
            and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
            and kwargs.get("attention_mask") is None
            and kwargs.get("local_size") is None
            and isinstance(kwargs.get("q_offset", 0), int) and kwargs.get("q_offset", 0) == 0
            and kwargs.get("q_length") is not None and kwargs.get("q_length") == kwargs.get("kv_length"))


@contextlib.contextmanager
def one_sequence() -> Iterator[None]:
    """While entered, `transformers` treats the positions as one sequence and skips its causal mask as it does
    outside a capture (module docstring): only around the capture of a batch known to be one sequence."""
    from transformers import masking_utils

    registry = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS
    find_packed, sdpa_mask = masking_utils.find_packed_sequence_indices, registry[MASK_KEY]
    causal = masking_utils.causal_mask_function

    def sdpa_mask_skipping_causal(*args, **kwargs):
        if not args and causal_skip(kwargs, causal):
            return None
        return sdpa_mask(*args, **kwargs)

    masking_utils.find_packed_sequence_indices = _not_packed
    registry[MASK_KEY] = sdpa_mask_skipping_causal
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find_packed
        registry[MASK_KEY] = sdpa_mask


def _not_packed(position_ids) -> None:
    return None


#: attention implementations this module can make batch invariant (the ones with a per-call mask rule below)
SUPPORTED = ("sdpa", "eager")

_segments: contextvars.ContextVar[tuple[tuple[int, int], ...] | None] = contextvars.ContextVar(
    "dwdp_attention_segments", default=None)
_lock = threading.Lock()
_owners: dict[str, int] = {}
_saved: dict[str, Any] = {}   # implementation -> the registry's local entry before the first install (or _ABSENT)
_ABSENT = object()


class BatchInvariantAttentionError(ValueError):
    """The model's attention cannot be made batch invariant (its implementation is not in ``SUPPORTED``)."""


def segments(positions: list[int]) -> tuple[tuple[int, int], ...]:
    """``(start, end)`` of each packed sequence: a new one wherever a position is not the previous + 1 (pure)."""
    starts = [i for i, p in enumerate(positions) if i == 0 or p != positions[i - 1] + 1]
    return tuple(zip(starts, starts[1:] + [len(positions)]))


def alone_mask_needed(implementation: str, length: int, sliding_window: int | None) -> bool:
    """Whether a sequence of ``length`` tokens run alone gets a mask tensor (pure): SDPA skips the causal mask
    (``is_causal=True``) unless a sliding window is shorter than the sequence; eager always builds one."""
    if implementation == "eager":
        return True
    return sliding_window is not None and length > sliding_window


@dataclass
class PerSequence:
    """One model's batch-invariant attention; ``close()`` undoes it (idempotent)."""
    implementation: str
    handles: list = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for h in self.handles:
            h.remove()
        _release(self.implementation)


def install_per_sequence(model: Any) -> PerSequence:
    """Make ``model``'s attention batch invariant (module docstring); raises ``BatchInvariantAttentionError``
    for an implementation outside ``SUPPORTED``."""
    implementation = str(getattr(model.config, "_attn_implementation", None))
    if implementation not in SUPPORTED:
        raise BatchInvariantAttentionError(
            f"--batch-invariant: the model's attention runs {implementation!r}; batch-invariant attention covers "
            f"{', '.join(SUPPORTED)} (load the model with one of them, or drop --batch-invariant)")
    _acquire(implementation)
    installed = PerSequence(implementation)
    tokens: list = []

    def before(_module, _args, kwargs):
        positions = kwargs.get("position_ids")
        found = None
        if positions is not None and positions.shape[0] == 1 and positions.shape[-1] > 1:
            import torch

            if positions.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("batch-invariant attention reads the packed positions on the host and cannot "
                                   "run inside a CUDA-graph capture (--batch-invariant excludes --cuda-graphs)")
            found = segments(positions[0].tolist())
        tokens.append(_segments.set(found if found is not None and len(found) > 1 else None))

    def after(_module, _args, _kwargs, _output):
        if tokens:
            _segments.reset(tokens.pop())

    installed.handles = [model.register_forward_pre_hook(before, with_kwargs=True),
                         model.register_forward_hook(after, with_kwargs=True, always_call=True)]
    return installed


def _registry():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _acquire(implementation: str) -> None:
    with _lock:
        if _owners.get(implementation, 0) == 0:
            registry = _registry()
            _saved[implementation] = registry._local_mapping.get(implementation, _ABSENT)
            registry[implementation] = _wrapper(implementation, _inner_lookup(implementation))
        _owners[implementation] = _owners.get(implementation, 0) + 1


def _release(implementation: str) -> None:
    with _lock:
        _owners[implementation] -= 1
        if _owners[implementation] == 0:
            registry, saved = _registry(), _saved.pop(implementation)
            if saved is _ABSENT:
                registry._local_mapping.pop(implementation, None)
            else:
                registry[implementation] = saved


def _inner_lookup(implementation: str) -> Callable[[Any], Callable]:
    """``module -> the attention function the module would call`` without us."""
    if implementation == "eager":
        # `transformers` passes each modeling module's own eager function as the lookup's default (gpt-oss's
        # handles its sinks): take it from the attention module's modeling module
        return lambda module: sys.modules[type(module).__module__].eager_attention_forward
    original = _registry()[implementation]
    return lambda module: original


def _wrapper(implementation: str, inner_for: Callable[[Any], Callable]) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        inner = inner_for(module)
        spans = _segments.get()
        if spans is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] or spans[-1][1] != query.shape[2]:
            return inner(module, query, key, value, attention_mask, **kwargs)
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        outputs = []
        for start, end in spans:
            mask = None
            if attention_mask is not None and alone_mask_needed(implementation, end - start, window):
                mask = attention_mask[..., start:end, start:end]
            out, _ = inner(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], mask,
                           **kwargs)
            outputs.append(out)
        import torch

        return torch.cat(outputs, dim=1), None

    attention.dwdp_batch_invariant = True
    return attention
