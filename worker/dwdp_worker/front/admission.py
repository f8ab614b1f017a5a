"""Admission: may this request run on this model and front? Pure functions, no asyncio, no torch.

Runs in the front before a request is queued (a bad request never reaches a rank), in two steps:
  1. before tokenizing a text prompt, ``text_fits``: a text longer than the longest step the front can
     run × the longest token of the vocabulary (in characters) cannot fit — refused without the cost of
     tokenizing it (a 10 MB prompt is a 400 in microseconds, not seconds of tokenizer work);
  2. on the token ids, ``admit``: non-empty, ids in the vocabulary, and the longest step (prompt +
     ``max_tokens`` − 1: the last generated token is never fed back) within the model's context and
     the front's ``max_num_tokens`` (so ``batcher.pack`` always fits the head of the queue alone).

Why step 1 is a sound bound: every token of the vocabulary stands for at most ``max_token_chars``
characters of input (byte-level BPE: a token is a string of byte symbols, one per input byte ≥ one
character; SentencePiece: pieces are substrings). A normalizer that deletes characters could make a
longer text fit; such a text is refused with the reason (the client can send token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from dwdp_runtime.serving_options import DEFAULTS


class Param(StrEnum):
    """The request field a refusal names (the OpenAI error body's ``param``)."""

    PROMPT = "prompt"
    MAX_TOKENS = "max_tokens"
    KV_TRANSFER_PARAMS = "kv_transfer_params"


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot be served here (a 400): what to change, and the field to change."""

    message: str
    param: Param



@dataclass(frozen=True)
class Limits:
    max_num_tokens: int
    vocab_size: int
    max_positions: int
    max_num_seqs: int = DEFAULTS.max_num_seqs
    max_new_tokens: int = DEFAULTS.max_new_tokens
    kv_enabled: bool = False

    @property
    def longest_step(self) -> int:
        """The most tokens one sequence may reach in a forward."""
        return min(self.max_positions, self.max_num_tokens)


def text_fits(text: str, max_tokens: int, limits: Limits, max_token_chars: int) -> Refusal | None:
    """Why a text prompt cannot fit before tokenizing it, or ``None``."""
    budget = limits.longest_step - max_tokens + 1
    if budget < 1:
        return Refusal(f"max_tokens={max_tokens} leaves no room for a prompt: this server runs steps of at most "
                       f"{limits.longest_step} tokens; lower max_tokens", Param.MAX_TOKENS)
    most = budget * max(1, max_token_chars)
    if len(text) > most:
        return Refusal(f"prompt text of {len(text)} characters cannot fit: with max_tokens={max_tokens} a prompt may "
                       f"have {budget} tokens, at most {max_token_chars} characters each ({most} characters); "
                       f"shorten the prompt", Param.PROMPT)
    return None


def admit(tokens: list[int], max_tokens: int, limits: Limits) -> Refusal | None:
    """Why the request cannot be served, or ``None`` when it can."""
    if not tokens:
        return Refusal("prompt is empty: send at least one token (or non-empty text)", Param.PROMPT)
    bad = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if bad:
        shown = ", ".join(str(t) for t in bad[:5]) + (", …" if len(bad) > 5 else "")
        return Refusal(f"token ids out of range [0, {limits.vocab_size}) (the model's vocabulary): {shown}", Param.PROMPT)
    longest = len(tokens) + max_tokens - 1
    if longest > limits.max_positions:
        return Refusal(f"prompt of {len(tokens)} tokens + max_tokens={max_tokens} needs {longest} positions; "
                       f"the model supports {limits.max_positions}: shorten the prompt or lower max_tokens", Param.PROMPT)
    if longest > limits.max_num_tokens:
        return Refusal(f"prompt of {len(tokens)} tokens + max_tokens={max_tokens} needs {longest} tokens in one "
                       f"forward; this server packs at most --max-num-tokens={limits.max_num_tokens}: shorten the "
                       f"prompt or lower max_tokens", Param.PROMPT)
    return None


def new_tokens_fit(max_tokens: int, remote_decode: bool, limits: Limits) -> Refusal | None:
    """Why ``max_tokens`` / ``kv_transfer_params`` cannot be served, or ``None``."""
    if remote_decode and not limits.kv_enabled:
        return Refusal("kv_transfer_params.do_remote_decode: KV transfer is off on this server (start it with "
                       "--kv-budget-bytes, or spec.kvTransfer in the DwdpGroup)", Param.KV_TRANSFER_PARAMS)
    if remote_decode and max_tokens != 1:
        return Refusal(f"kv_transfer_params.do_remote_decode needs max_tokens=1 (got {max_tokens}): the prefill makes "
                       f"the first token, the decode engine the rest", Param.KV_TRANSFER_PARAMS)
    if max_tokens > limits.max_new_tokens:
        return Refusal(f"max_tokens={max_tokens} > --max-new-tokens={limits.max_new_tokens}: this is a context "
                       f"server; decode long outputs on a decode engine (kv_transfer_params, docs/KV_TRANSFER.md)",
                       Param.MAX_TOKENS)
    return None
