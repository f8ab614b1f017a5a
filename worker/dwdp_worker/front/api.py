"""HTTP routes (thin): parse, hand to ``Supervisor``, shape the answer.

Routes: the OpenAI-compatible ones (``openai_routes``: ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /v1/models/{id}``), ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, ``GET /v1/load``
(the prefill load record the operator's autoscaler reads: ``dwdp_runtime.load.schema.LoadReport``).

Invariants:
  * Statuses (each route's OpenAPI entry lists the ones it returns): malformed JSON 400 ``json_invalid``,
    schema violations 422, inputs the model cannot take (empty, too long, ids out of range, text without a
    tokenizer) 400, unknown model 404, body too slow 408, too large 413, queue full or KV budget full 429, draining / not
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

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from dwdp_runtime.load.schema import LoadReport

from .http_errors import install_handlers
from .http_limits import BodyGuard, HttpBounds
from .openai.routes import openai_router, register_request_schemas
from .supervisor import Supervisor

COUNTED_PATHS = ("/v1/completions", "/v1/chat/completions")  # dwdp_requests_total, request latency

PROBE_DOC = {200: {"description": "the probe passes (JSON body: status, reasons, ranks)"},
             503: {"description": "the probe fails; the body says why"}}


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
        if scope.get("path") in COUNTED_PATHS and status:
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

    app.include_router(openai_router(sup))

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

    @app.get("/v1/load", response_model=LoadReport,
             responses={200: {"description": "this front's prefill load (also while starting or draining: see "
                                             "ready and draining)"}})
    async def load(isl: int | None = Query(None, ge=1, le=10_000_000, description="prompt length of the TTFT "
                                           "estimate (default: the recent mean)")):
        return JSONResponse(sup.load_report(isl).model_dump(mode="json"))

    register_request_schemas(app)
    return app
