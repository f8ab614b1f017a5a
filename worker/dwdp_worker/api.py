"""HTTP routes (thin): parse, hand to ``Supervisor``, shape the answer.

Routes: ``POST /v1/completions``, ``GET /v1/models``, ``GET /healthz``, ``GET /readyz``, ``GET /metrics``.

Invariants:
  * Statuses (each route's OpenAPI entry lists the ones it returns): malformed JSON 400 ``json_invalid``,
    schema violations 422, inputs the model cannot take (empty, too long, ids out of range, text without a
    tokenizer) 400, unknown model 404, body too slow 408, too large 413, queue full 429, draining / not
    ready / rank died 503. Error bodies, headers (``Retry-After``, ``Allow``): ``http_errors``. Body and
    header bounds: ``http_limits``.
  * A bad request never reaches a rank: admission (``admission``, in ``Supervisor.submit``) runs first; a
    text prompt is length-checked before it is tokenized, and tokenized off the event loop.
  * A client that disconnects cancels its request: it leaves the queue, and a step of it already on a rank
    is its last (a ``max_tokens`` loop stops at the next step).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from . import text
from .dispatch import Job
from .http_errors import error_docs, error_response, install_handlers, parse_completion
from .http_limits import BodyGuard, HttpBounds
from .schemas import Choice, CompletionRequest, CompletionResponse, Logprobs, Timings, Usage
from .supervisor import Supervisor

PROBE_DOC = {200: {"description": "the probe passes (JSON body: status, reasons, ranks)"},
             503: {"description": "the probe fails; the body says why"}}


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _answer_or_cancel(sup: Supervisor, request: Request, job: Job) -> Job | None:
    """The finished job, or ``None`` after cancelling it because its client went away."""
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({job.future, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not job.future.done():
        sup.cancel(job)
        return None
    return job.future.result()  # raises the job's ServeError


def _completion(sup: Supervisor, req: CompletionRequest, job: Job) -> CompletionResponse:
    tok = sup.tokenizer
    lp = None
    if req.logprobs is not None:
        lp = Logprobs(tokens=[text.token_str(tok, t) for t in job.generated], token_logprobs=job.logprobs,
                      top_logprobs=[{text.token_str(tok, i): v for i, v in top} for top in job.tops])
    now = time.monotonic()
    return CompletionResponse(
        id=job.id, created=int(time.time()), model=sup.model_name,
        choices=[Choice(text=text.decode(tok, job.generated), token_ids=job.generated, logprobs=lp)],
        usage=Usage(prompt_tokens=job.prompt_len, completion_tokens=len(job.generated),
                    total_tokens=job.prompt_len + len(job.generated)),
        timings=Timings(queue_s=round((job.t_first or now) - job.t_admit, 6), compute_s=round(job.compute_s, 6),
                        prefetch_wait_s=round(job.prefetch_wait_s, 6), total_s=round(now - job.t_admit, 6),
                        forwards=len(job.generated), ranks=job.ranks, batch_sequences=job.batch_sizes))


class CountAndClose:
    """ASGI middleware: counts completions answers by status in the metrics, and ends keep-alive while
    draining (a client must not reuse this connection for its next request, or that request races the
    close of the idle connection at exit: a reset)."""

    def __init__(self, app, sup: Supervisor):
        self.app, self.sup = app, sup

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), []

        async def send_counted(msg):
            if msg["type"] == "http.response.start":
                status.append(msg["status"])
                if self.sup.draining:
                    msg = {**msg, "headers": [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"connection"]
                           + [(b"connection", b"close")]}
            await send(msg)

        await self.app(scope, receive, send_counted)
        if scope.get("path") == "/v1/completions" and status:
            self.sup.metrics.requests.labels(code=str(status[0])).inc()
            if status[0] == 200:
                self.sup.metrics.latency.observe(time.monotonic() - t0)


def asgi_app(sup: Supervisor, bounds: HttpBounds, *, stopping: asyncio.Event | None = None):
    """What uvicorn serves: the routes inside the body bounds, inside the metrics counter."""
    guarded = BodyGuard(create_app(sup), max_bytes=bounds.max_body_bytes, timeout_s=bounds.body_timeout_s,
                        stopping=stopping)
    return CountAndClose(guarded, sup)


def create_app(sup: Supervisor) -> FastAPI:
    app = FastAPI(title="dwdp-worker", description="DWDP context (prefill) server", version="0.1.0")
    install_handlers(app)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses=error_docs(400, 404, 408, 413, 422, 429, 500, 503),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"$ref": "#/components/schemas/CompletionRequest"}}}}})
    async def completions(request: Request):
        req = parse_completion(await request.body())
        if req.model is not None and req.model != sup.model_name:
            return error_response(404, f"model {req.model!r} is not served here; this server serves "
                                       f"{sup.model_name!r} (see GET /v1/models)", param="model",
                                  code="model_not_found")
        job = await sup.submit(req.prompt, max_tokens=req.max_tokens, top_n=req.logprobs or 0)
        done = await _answer_or_cancel(sup, request, job)
        if done is None:
            return Response(status_code=499)  # nobody reads it: the client is gone (counted in metrics)
        return _completion(sup, req, done)

    @app.get("/v1/models")
    async def models():
        limits = sup.limits()
        return {"object": "list", "data": [{
            "id": sup.model_name, "object": "model", "created": int(sup.started_at), "owned_by": "dwdp",
            "root": sup.model_dir, "max_model_len": limits.max_positions if limits else None,
            "vocab_size": limits.vocab_size if limits else None, "has_tokenizer": sup.tokenizer is not None,
            "ranks": len(sup.ranks), "groups": len({h.spec.group for h in sup.ranks}),
        }]}

    @app.get("/healthz", responses=PROBE_DOC)
    async def healthz():
        live, _, body = sup.probe()
        return JSONResponse(body, status_code=200 if live else 503)

    @app.get("/readyz", responses=PROBE_DOC)
    async def readyz():
        _, ready, body = sup.probe()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text exposition",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics():
        return Response(sup.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    _register_request_schema(app)
    return app


def _register_request_schema(app: FastAPI) -> None:
    """The completions body is parsed by ``http_errors.parse_completion``: add its schema to the document."""
    from fastapi.openapi.utils import get_openapi

    def openapi():
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schema = CompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas["CompletionRequest"] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
