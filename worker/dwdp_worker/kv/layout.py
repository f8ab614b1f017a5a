"""A sequence's KV stream: every layer's key then value tensor, contiguous, each at an aligned offset.

``plan_stream(shapes)`` is pure (shapes, dtypes → descriptors); ``write_stream`` and ``read_stream``
move tensors in and out of a flat byte buffer (a region view on the prefill side, the pulled buffer
on the decode side). The layout is the one `transformers` caches: per layer ``[1, heads, seq, dim]``
(DeepSeek-V3: MLA expanded, key ``dim = qk_nope + qk_rope``, value ``dim = v_head_dim``, so key and
value shapes differ and each has its own descriptor).
"""

from __future__ import annotations

from typing import Sequence

from .params import STREAM_ALIGN, KvKind, KvTensorDesc


def _align(n: int) -> int:
    return -(-n // STREAM_ALIGN) * STREAM_ALIGN


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_stream(layers: Sequence[tuple[tuple[tuple[int, ...], str, int], tuple[tuple[int, ...], str, int]]]
                ) -> tuple[list[KvTensorDesc], int]:
    """``layers[i] = ((key_shape, dtype, itemsize), (value_shape, dtype, itemsize))`` → descriptors, stream bytes."""
    descs, offset = [], 0
    for layer, pair in enumerate(layers):
        for kind, (shape, dtype, itemsize) in zip((KvKind.KEY, KvKind.VALUE), pair):
            nbytes = itemsize
            for d in shape:
                nbytes *= d
            descs.append(KvTensorDesc(layer=layer, kind=kind, dtype=dtype, shape=tuple(shape), offset=offset,
                                      nbytes=nbytes))
            offset = _align(offset + nbytes)
    return descs, offset


def plan_for(kv: Sequence[tuple[object, object]]) -> tuple[list[KvTensorDesc], int]:
    """Descriptors for per-layer ``(key, value)`` tensors."""
    return plan_stream([tuple((tuple(t.shape), dtype_name(t.dtype), t.element_size()) for t in pair)
                        for pair in kv])


def write_stream(buffer, descs: Sequence[KvTensorDesc], kv: Sequence[tuple[object, object]]) -> None:
    """Copy every tensor into ``buffer`` (a flat uint8 tensor on the tensors' device) at its offset."""
    flat = [t for pair in kv for t in pair]
    for d, t in zip(descs, flat, strict=True):
        buffer[d.offset:d.offset + d.nbytes].view(t.dtype).view(t.shape).copy_(t)


def read_stream(buffer, descs: Sequence[KvTensorDesc]) -> list[tuple[object, object]]:
    """Views of ``buffer`` as the per-layer ``(key, value)`` tensors the descriptors name (no copy)."""
    import torch

    out: dict[int, dict[KvKind, object]] = {}
    for d in descs:
        t = buffer[d.offset:d.offset + d.nbytes].view(getattr(torch, d.dtype)).view(d.shape)
        out.setdefault(d.layer, {})[d.kind] = t
    if sorted(out) != list(range(len(out))) or any(len(v) != 2 for v in out.values()):
        raise ValueError("KV descriptors must name a key and a value for every layer 0..L-1")
    return [(out[i][KvKind.KEY], out[i][KvKind.VALUE]) for i in range(len(out))]
