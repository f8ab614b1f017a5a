"""HTTP routes (thin): request validation and response shaping around ``Supervisor``.

Routes: ``POST /v1/completions``, ``GET /v1/models``, ``GET /healthz``, ``GET /readyz``,
``GET /metrics``.

Invariants:
  * Every error is an OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}``
    with a message that says what to change: malformed JSON 400, schema violations 422, inputs the
    model cannot take (empty, too long, ids out of range, text without a tokenizer) 400, unknown
    model 404, queue full 429, draining/not ready/rank died 503. No traceback ever reaches a client.
  * A bad request never reaches a rank: admission (``batcher.admit``) runs before ``submit``.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import text
from .batcher import admit
from .schemas import Choice, CompletionRequest, CompletionResponse, Logprobs, Timings, Usage, error_json
from .supervisor import ServeError, Supervisor

log = logging.getLogger("dwdp_worker.api")


def _error(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
           code: str | None = None) -> JSONResponse:
    return JSONResponse(error_json(message, type=type, param=param, code=code), status_code=status)


def _describe_validation(errors) -> tuple[str, str | None]:
    parts, params = [], []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if e.get("type") == "extra_forbidden":
            msg = "unknown field (this server accepts: " + ", ".join(CompletionRequest.model_fields) + ")"
        parts.append(f"{where}: {msg}")
        params.append(loc[0] if loc else None)
    uniq = list(dict.fromkeys(parts))
    return "; ".join(uniq[:6]) + (f"; … ({len(uniq) - 6} more)" if len(uniq) > 6 else ""), (params[0] if params else None)


def create_app(sup: Supervisor) -> FastAPI:
    app = FastAPI(title="dwdp-worker", description="DWDP context (prefill) server", version="0.1.0")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        bad_json = [e for e in errors if e.get("type") == "json_invalid"]
        if bad_json:
            ctx = bad_json[0].get("ctx", {}).get("error", "")
            return _error(400, f"the request body is not valid JSON ({ctx}); send a JSON object",
                          code="json_invalid")
        message, param = _describe_validation(errors)
        return _error(422, message, param=param, code="invalid_field")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), type="http_error")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")

    @app.middleware("http")
    async def _count(request: Request, call_next):
        t0 = time.monotonic()
        response = await call_next(request)
        if sup.draining:
            # No keep-alive while draining: a client must not reuse this connection for its next
            # request, or that request races the close of the idle connection at exit (a reset).
            response.headers["connection"] = "close"
        if request.url.path == "/v1/completions":
            sup.metrics.requests.labels(code=str(response.status_code)).inc()
            if response.status_code == 200:
                sup.metrics.latency.observe(time.monotonic() - t0)
        return response

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(req: CompletionRequest):
        if req.model is not None and req.model != sup.model_name:
            return _error(404, f"model {req.model!r} is not served here; this server serves {sup.model_name!r} "
                               f"(see GET /v1/models)", param="model", code="model_not_found")
        limits = sup.limits()
        if limits is None or not sup.tokenizer_ready:
            return _error(503, "the server is not ready yet (ranks are starting or loading weights); see /readyz",
                          type="unavailable")
        if isinstance(req.prompt, str):
            if sup.tokenizer is None:
                return _error(400, "this checkpoint has no tokenizer: send prompt as a list of token ids",
                              param="prompt")
            tokens = text.encode(sup.tokenizer, req.prompt)
        else:
            tokens = req.prompt
        why = admit(tokens, req.max_tokens, limits)
        if why:
            return _error(400, why, param="prompt" if "prompt" in why or "token" in why else "max_tokens")
        try:
            job = await sup.submit(tokens, max_tokens=req.max_tokens, top_n=req.logprobs or 0)
        except ServeError as exc:
            return _error(exc.status, str(exc), type=exc.kind)
        tok = sup.tokenizer
        lp = None
        if req.logprobs is not None:
            lp = Logprobs(tokens=[text.token_str(tok, t) for t in job.generated],
                          token_logprobs=job.logprobs,
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

    @app.get("/v1/models")
    async def models():
        limits = sup.limits()
        return {"object": "list", "data": [{
            "id": sup.model_name, "object": "model", "created": int(sup.started_at), "owned_by": "dwdp",
            "root": sup.model_dir, "max_model_len": limits.max_positions if limits else None,
            "vocab_size": limits.vocab_size if limits else None, "has_tokenizer": sup.tokenizer is not None,
            "ranks": len(sup.ranks), "groups": len({h.spec.group for h in sup.ranks}),
        }]}

    @app.get("/healthz")
    async def healthz():
        live, _, body = sup.probe()
        return JSONResponse(body, status_code=200 if live else 503)

    @app.get("/readyz")
    async def readyz():
        _, ready, body = sup.probe()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(sup.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
