"""Wire models of the OpenAI-compatible API: ``/v1/completions``, ``/v1/chat/completions``, SSE chunks.

What a client or gateway sends is parsed here (types only); what it *means* for this server — which
values are served, how prompts become token lists — is decided in ``openai_requests.py``.

Invariants:
  * Unknown request fields are accepted and ignored (``extra="allow"``), like vLLM: gateways and SDKs
    add fields (``user``, ``metadata``, ``stream_options`` …) that do not change a greedy answer.
    ``openai_requests`` logs each unknown field name once per process.
  * Known fields keep strict types: token ids and counts are strict integers (``"5"``, ``5.0`` and
    ``true`` are refused with 422), text is valid Unicode (a lone UTF-16 surrogate is a 422).
  * Values of the right type that this server does not serve (``temperature`` 0.7, ``n`` 2, a
    penalty, …) are *not* refused here: that is a 400 with the reason, from ``openai_requests``.
  * Response and chunk models follow OpenAI's shapes field for field, so the ``openai`` package
    parses them into its own types; DWDP extras (``token_ids``, ``timings``) ride along as extra
    fields the SDK keeps.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from ...kv.params import RemoteDecodeRequest

from ..schemas import Timings, Usage

MAX_LOGPROBS = 20          # OpenAI's own cap on top-N log-probabilities per position
MAX_STOP_SEQUENCES = 4     # OpenAI's cap on `stop` strings

Number = StrictFloat | StrictInt
TokenIds = list[StrictInt]


def _valid_unicode(v: Any) -> Any:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); Python keeps them in str and the tokenizer
    (or any UTF-8 encode) then raises deep inside: refuse them at the edge with the reason."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"text must be valid Unicode: a lone UTF-16 surrogate {v[exc.start]!r} "
                             f"at character {exc.start}") from None
    elif isinstance(v, list):
        for item in v:
            _valid_unicode(item)
    return v


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat. Defaults are the neutral (greedy) values."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=0, description="tokens to generate (default 1: the "
                                         "context phase); 0 only with echo (prompt scoring)")
    temperature: Number | None = Field(default=None, description="only 0 (greedy) is served")
    top_p: Number | None = Field(default=None, description="only 1 is served")
    n: StrictInt | None = Field(default=None, description="only 1 is served")
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    seed: StrictInt | None = Field(default=None, description="accepted: greedy decoding is deterministic")
    stop: StrictStr | list[StrictStr] | None = Field(default=None, description=f"up to {MAX_STOP_SEQUENCES} strings")
    ignore_eos: StrictBool = Field(default=False, description="keep generating past the end-of-sequence token "
                                   "(vLLM's field)")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None

    @field_validator("model", "user", "stop")
    @classmethod
    def _unicode(cls, v):
        return _valid_unicode(v)


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds] = Field(
        description="text, a list of texts, token ids, or a list of token-id lists (one choice per prompt)")
    echo: StrictBool = Field(default=False, description="prepend the prompt (and its logprobs) to the choice")
    logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS,
                                       description=f"top-N (0..{MAX_LOGPROBS}) log-probabilities per token")
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None
    kv_transfer_params: RemoteDecodeRequest | None = Field(
        default=None, description='DWDP extra (vLLM\'s name): {"do_remote_decode": true} keeps the prompt\'s KV for a '
                                  'decode engine to pull over NIXL (max_tokens 1; docs/KV_TRANSFER.md)')

    @field_validator("prompt")
    @classmethod
    def _prompt_unicode(cls, v):
        return _valid_unicode(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None

    @field_validator("role", "content")
    @classmethod
    def _unicode(cls, v):
        if isinstance(v, list):
            for part in v:
                _valid_unicode(part.get("text"))
            return v
        return _valid_unicode(v)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    add_generation_prompt: StrictBool = Field(default=True, description="end the rendered prompt with the "
                                              "assistant turn header (vLLM's name)")
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


# -- responses ----------------------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    token_ids: list[int] = Field(description="DWDP extra: the generated token ids")
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["length", "stop"] | None
    kv_transfer_params: dict[str, Any] | None = Field(
        default=None, description="DWDP extra: what a decode engine needs to pull this prompt's KV "
                                  "(kv.params.KvTransferParams); null unless the request asked for it")


class _ResponseHead(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage


class CompletionResponse(_ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    timings: Timings | list[Timings] = Field(description="DWDP extra: one prompt's timings, or one per prompt")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["length", "stop"]
    token_ids: list[int] = Field(description="DWDP extra: the generated token ids")


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    timings: Timings
