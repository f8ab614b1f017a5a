"""Request/response models of the OpenAI-style completions API (the subset a context server serves).

Invariants:
  * Every request model forbids unknown fields (``extra="forbid"``): a typo such as ``max_token``
    is a 422 naming the field, never silently ignored.
  * Token ids and ``max_tokens`` are *strict* integers: ``"5"``, ``5.0`` and ``true`` are refused
    (JSON has no int/bool distinction problems we want to paper over).
  * Text fields are valid Unicode: a lone UTF-16 surrogate (legal in JSON, ``"\ud800"``) is a 422.
  * Only greedy decoding exists (``temperature`` 0, ``n`` 1): anything else is refused with the reason,
    not approximated.
  * Range checks that need the model (vocab size, context length, text length) live in
    ``admission.py``; this module only checks what the request alone can tell.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, field_validator

MAX_LOGPROBS = 20


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | list[StrictInt] = Field(
        description="text (needs a checkpoint with a tokenizer) or a list of token ids")
    max_tokens: StrictInt = Field(default=1, ge=1, description="1 = the context phase: one forward, first token")
    temperature: StrictFloat | StrictInt = Field(default=0, description="only 0 (greedy) is served")
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                       description=f"top-N (0..{MAX_LOGPROBS}) log-probabilities per generated token")
    n: StrictInt = Field(default=1, description="only 1 is served")
    stream: bool = Field(default=False, description="streaming is not served")
    user: StrictStr | None = None

    @field_validator("prompt", "model", "user")
    @classmethod
    def _valid_unicode(cls, v):
        # JSON may carry lone UTF-16 surrogates ("\ud800"); Python keeps them in str, and the
        # tokenizer (and any UTF-8 encode) then raises deep inside: refuse them here with the reason.
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"text must be valid Unicode: a lone UTF-16 surrogate "
                                 f"{v[exc.start]!r} at character {exc.start}") from None
        return v

    @field_validator("temperature")
    @classmethod
    def _greedy_only(cls, v):
        if v != 0:
            raise ValueError("only temperature 0 (greedy) is served by this context worker")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v):
        if v != 1:
            raise ValueError("only n=1 is served")
        return v

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v):
        if v:
            raise ValueError("streaming is not served by this context worker; send stream=false")
        return v


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]


class Choice(BaseModel):
    index: int = 0
    text: str
    token_ids: list[int]
    logprobs: Logprobs | None = None
    finish_reason: Literal["length"] = "length"


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    queue_s: float = Field(description="waiting in the front queue before the first forward")
    compute_s: float = Field(description="model compute in the rank, summed over forwards")
    prefetch_wait_s: float = Field(description="exposed expert-prefetch wait, summed over forwards")
    total_s: float = Field(description="from admission to answer")
    forwards: int
    ranks: list[int] = Field(description="global ids of the ranks that served this request's forwards")
    batch_sequences: list[int] = Field(description="sequences packed into each forward this request rode in")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    timings: Timings


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error answer of the API (OpenAI style)."""

    error: ErrorBody


def error_json(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": ErrorBody(message=message, type=type, param=param, code=code).model_dump()}

