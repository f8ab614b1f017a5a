"""Packed prefill that keeps the model's own KV cache, and greedy continuation from a cache.

`transformers` recognises packed sequences (position ids restarting at 0) only when no cache is passed
(``masking_utils``: "only if … we don't have cache"); with a cache it would let sequences attend to
each other. So ``cached_prefill`` builds the block-diagonal mask the model would build *without* a cache
(the model's own mask function, same arguments) and passes it explicitly next to a ``DynamicCache``:
the attention layers see the identical mask, so the logits are bitwise those of the no-cache packed
forward (``packing.packed_logits``), and each sequence's K/V is a slice ``[:, :, start:end]`` of the
packed cache.

``continue_greedy`` is plain ``model.generate`` (greedy) on ``prompt + [first_token]`` with the cache of
the prompt: generate runs only the uncached token(s). The engine (``max_tokens > 1``) and the reference
decode client (``kv.client``) both use it, so both decode exactly like ``transformers``.

Works on transformers 5.17 (``past_key_values=``) and 5.24 (``cache=``): the keyword is read from the
model's signature.
"""

from __future__ import annotations

import inspect
from typing import Sequence

from ..model.packing import pack


def cache_kwarg(model) -> str:
    """The name the model's forward/generate take the cache under (``cache`` from transformers 5.2x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _packed_mask(model, input_ids, position_ids):
    import transformers.masking_utils as mu

    config = model.config
    fn = mu.create_causal_mask if getattr(config, "sliding_window", None) is None \
        else mu.create_sliding_window_causal_mask
    params = inspect.signature(fn).parameters
    kw = {"config": config, "attention_mask": None, "position_ids": position_ids}
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = \
        model.get_input_embeddings()(input_ids)
    for name in ("cache", "past_key_values"):
        if name in params:
            kw[name] = None
    if "cache_position" in params:
        import torch

        kw["cache_position"] = torch.arange(input_ids.shape[1], device=input_ids.device)
    return fn(**kw)


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cached_prefill(model, sequences: Sequence[Sequence[int]], device):
    """One packed forward with a cache → (last-position logits ``[n, vocab]`` float32 CPU,
    per sequence the per-layer ``(key, value)`` views ``[1, heads, len, dim]`` on ``device``)."""
    import torch

    input_ids, position_ids, last = pack(sequences, device)
    cache = new_cache(model)
    with torch.inference_mode():
        mask = _packed_mask(model, input_ids, position_ids)
        out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                    logits_to_keep=last, **{cache_kwarg(model): cache})
        logits = out.logits[0].float().cpu()
    per_seq, start = [], 0
    for seq in sequences:
        end = start + len(seq)
        per_seq.append([(layer.keys[:, :, start:end], layer.values[:, :, start:end]) for layer in cache.layers])
        start = end
    return logits, per_seq


def cache_from(model, kv):
    """A ``DynamicCache`` holding per-layer ``(key, value)`` tensors (the decode side's starting point)."""
    cache = new_cache(model)
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    return cache


def continue_greedy(model, prompt: Sequence[int], first_token: int, cache, max_new_tokens: int,
                    max_time_s: float | None = None):
    """Greedy tokens ``[first_token, …]`` (``max_new_tokens`` in all, fewer when ``max_time_s`` — generate's own
    time limit — ran out) and the float32 CPU logits that chose each token after the first, decoding from
    ``cache`` (the prompt's KV)."""
    import torch

    if max_new_tokens <= 1:
        return [first_token], None
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + [first_token]], dtype=torch.long, device=device)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens - 1,
                             min_new_tokens=max_new_tokens - 1, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
                             **({"max_time": max_time_s} if max_time_s else {}), **{cache_kwarg(model): cache})
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    return [first_token] + tokens, torch.stack([lg[0] for lg in out.logits]).float().cpu()
