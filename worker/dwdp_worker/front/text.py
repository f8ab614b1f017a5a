"""The front's tokenizer: text prompts in, token strings out. The one rule for "has a tokenizer".

Invariants:
  * A checkpoint has a tokenizer when it ships one of ``TOKENIZER_FILES`` (this rule only; nothing
    else decides it). Only the front loads it — ranks take token ids and never tokenize.
  * With no tokenizer, text prompts are refused with a 400 and token strings in ``logprobs`` are the
    decimal ids.
  * ``max_token_chars`` (the longest vocabulary entry, in characters) bounds how many characters one
    token can stand for: admission refuses a text that cannot fit before tokenizing it.
  * Tokenizing is CPU work (~0.7 s per MB of text on one core): the front runs ``encode`` on a worker
    thread (the Rust tokenizer releases the GIL: measured, the event loop keeps answering), never on the
    event loop.
"""

from __future__ import annotations

import pathlib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(model_dir) -> bool:
    d = pathlib.Path(model_dir)
    return any((d / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer, or ``None`` when it ships none (blocking: seconds for large vocabularies)."""
    if not has_tokenizer_files(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def max_token_chars(tokenizer) -> int:
    """The most characters of input one token of ``tokenizer`` can stand for (its longest vocabulary entry)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_str(tokenizer, token_id: int) -> str:
    if tokenizer is None:
        return str(token_id)
    return tokenizer.decode([token_id])


def decode(tokenizer, ids: list[int]) -> str:
    if tokenizer is None:
        return ""
    return tokenizer.decode(ids)
