"""Tokenizer access for the front process (text prompts in, token strings out).

Invariant: the front loads the checkpoint's tokenizer itself (the ranks never tokenize); with no
tokenizer files in the checkpoint, text prompts are refused with a 400 and token strings in
``logprobs`` are the decimal ids.
"""

from __future__ import annotations

import pathlib

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer_files(model_dir) -> bool:
    d = pathlib.Path(model_dir)
    return any((d / f).exists() for f in TOKENIZER_FILES)


def load_tokenizer(model_dir):
    """The checkpoint's tokenizer, or ``None`` when it ships none."""
    if not has_tokenizer_files(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


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
