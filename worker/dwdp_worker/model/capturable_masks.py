"""The causal SDPA mask of a one-sequence forward, decided inside a CUDA-graph capture as outside it.

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
"""

from __future__ import annotations

import contextlib
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
