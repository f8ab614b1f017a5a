"""Models shared by every route: token usage, DWDP timings, and the OpenAI-style error body.

The OpenAI request and response models themselves are in ``openai_schemas.py``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


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

