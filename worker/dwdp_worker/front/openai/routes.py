"""OpenAI-compatible routes (thin): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /v1/models/{id}``.

A request body is parsed (``http_errors.parse_body``: 400 ``json_invalid``, 422 schema) and planned
(``openai_requests``), its prompts are admitted and enqueued on the front (``openai_runs``; the
batcher packs prompts of one request and of other requests into the same forwards), and the answer
is formatted (``openai_format``) — whole, or as server-sent events (``openai_stream``).

Invariants:
  * Every error is OpenAI's error body (``{"error": {"message", "type", "param", "code"}}``) with the
    status the ``openai`` package maps to its typed exceptions (400 ``BadRequestError``, 404
    ``NotFoundError``, 422 ``UnprocessableEntityError``, 429 ``RateLimitError``, 5xx
    ``InternalServerError``).
  * A client that disconnects cancels its prompts (they leave the queue; a step on a rank is the last).
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from . import chat
from ..errors import ServeError
from ..http_errors import error_docs, error_response, parse_body, serve_error
from .format import chat_response, completion_response
from .requests import Endpoint, OpenAIRequestError, RequestPlan, plan_chat, plan_completion
from .runs import ClientGone, await_all, count_answered, not_ready, submit_all
from .schemas import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse
from .stream import stream_events
from ..supervisor import Supervisor

#: one server-sent event: ``data`` is a chunk's JSON (or ``[DONE]``), ``event`` the SSE default ("message")
SSE_EVENT_SCHEMA = {"type": "object", "required": ["data"],
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # proxies must not buffer a stream
CLIENT_GONE = 499  # nobody reads it: the client is gone (counted in metrics)
REQUEST_MODELS = {"CompletionRequest": CompletionRequest, "ChatCompletionRequest": ChatCompletionRequest}


def openai_error(exc: OpenAIRequestError | ServeError) -> JSONResponse:
    if isinstance(exc, OpenAIRequestError):
        return error_response(exc.status, str(exc), type=exc.type, param=exc.param, code=exc.code)
    return serve_error(exc)


def _body_doc(name: str) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def openai_router(sup: Supervisor) -> APIRouter:
    router = APIRouter()

    def model_check(model: str | None) -> None:
        if model is not None and model != sup.model_name:
            raise OpenAIRequestError(f"model {model!r} is not served here; this server serves {sup.model_name!r} "
                                     f"(see GET /v1/models)", status=404, param="model", code="model_not_found")

    async def run(plan: RequestPlan, request: Request):
        ids = f"{'chatcmpl' if plan.endpoint is Endpoint.CHAT else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        runs = await submit_all(sup, plan, streaming=plan.stream)
        if plan.stream:
            return StreamingResponse(stream_events(sup, plan, runs, id=ids, created=created),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            await await_all(sup, runs, request.receive)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)
        outcomes = [r.outcome(time.monotonic()) for r in runs]
        count_answered(sup, outcomes)
        if plan.endpoint is Endpoint.CHAT:
            return chat_response(plan, outcomes[0], sup.tokenizer, id=ids, created=created, model=sup.model_name)
        return completion_response(plan, outcomes, sup.tokenizer, id=ids, created=created, model=sup.model_name,
                                   kv_origin=sup.kv_origin)

    answers = {200: {"description": "the answer; with stream: true, server-sent events (OpenAI chunks, then "
                                    "data: [DONE])",
                     "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}}},
               **error_docs(400, 404, 408, 413, 422, 429, 500, 503)}

    async def answer(request: Request, model, make_plan):
        """Parse the body as ``model``, plan it (``make_plan(req)``), run it; errors in OpenAI's format."""
        req = parse_body(await request.body(), model)
        try:
            model_check(req.model)
            return await run(make_plan(req), request)
        except (OpenAIRequestError, ServeError) as exc:
            return openai_error(exc)

    def chat_plan(req: ChatCompletionRequest) -> RequestPlan:
        if not sup.tokenizer_ready:
            raise not_ready()
        render = lambda tok, msgs, gen: chat.render(tok, msgs, gen, model_dir=sup.model_dir)  # noqa: E731
        return plan_chat(req, sup.tokenizer, render)

    @router.post("/v1/completions", response_model=CompletionResponse, responses=answers,
                 openapi_extra=_body_doc("CompletionRequest"))
    async def completions(request: Request):
        return await answer(request, CompletionRequest, lambda req: plan_completion(req, sup.tokenizer))

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=answers,
                 openapi_extra=_body_doc("ChatCompletionRequest"))
    async def chat_completions(request: Request):
        return await answer(request, ChatCompletionRequest, chat_plan)

    def model_card() -> dict:
        limits = sup.limits()
        return {"id": sup.model_name, "object": "model", "created": int(sup.started_at), "owned_by": "dwdp",
                "root": sup.model_dir, "max_model_len": limits.max_positions if limits else None,
                "vocab_size": limits.vocab_size if limits else None, "has_tokenizer": sup.tokenizer is not None,
                "has_chat_template": chat.template_of(sup.tokenizer) is not None if sup.tokenizer is not None else False,
                "ranks": len(sup.ranks), "groups": len({h.spec.group for h in sup.ranks})}

    @router.get("/v1/models", responses=error_docs(503))
    async def models():
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}", responses=error_docs(404))
    async def model(model_id: str):
        if model_id != sup.model_name:
            return openai_error(OpenAIRequestError(
                f"model {model_id!r} is not served here; this server serves {sup.model_name!r}", status=404,
                param="model", code="model_not_found"))
        return model_card()

    return router


def register_request_schemas(app: FastAPI) -> None:
    """The request bodies are parsed by ``http_errors.parse_body``: add their schemas to the OpenAPI document."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, model in REQUEST_MODELS.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[name] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
