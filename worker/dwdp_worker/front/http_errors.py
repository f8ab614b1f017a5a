"""Errors as HTTP answers: one JSON shape, the headers each status owes, and the OpenAPI entries for them.

Invariants:
  * Every error is an OpenAI-style JSON body ``{"error": {"message", "type", "param", "code"}}`` with a
    message that says what to change; no traceback ever reaches a client.
  * 429 and 503 carry ``Retry-After`` (seconds); 405 carries ``Allow``; 408 and 413 close the connection
    (the rest of the body was never read).
  * The request bodies of ``POST /v1/completions`` and ``/v1/chat/completions`` are parsed here
    (``parse_body``), not by FastAPI, so
    every way a body can fail to be JSON (bad syntax, invalid UTF-8, another encoding, nesting deeper
    than the parser's limit) is the same documented 400 ``json_invalid``, and schema violations a 422.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import ServeError
from pydantic import BaseModel

from .schemas import ErrorResponse, error_json

#: the four shapes of an OpenAI ``prompt``; pydantic reports one error per union member, we say it once
PROMPT_FORMS = "a string, a list of strings, a list of token ids (strict integers) or a list of token-id lists"

log = logging.getLogger("dwdp_worker.front.api")


class RequestInvalid(Exception):
    def __init__(self, status: int, message: str, *, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, retry_after_s: int | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    out = dict(headers or {})
    if retry_after_s is not None:
        out["Retry-After"] = str(retry_after_s)
    if status in (408, 413):
        out["Connection"] = "close"
    return JSONResponse(error_json(message, type=type, param=param, code=code), status_code=status, headers=out)


def serve_error(exc: ServeError) -> JSONResponse:
    return error_response(exc.status, str(exc), type=exc.kind, param=getattr(exc, "param", None),
                          retry_after_s=exc.retry_after_s)


def describe_validation(errors) -> tuple[str, str | None]:
    parts, params = [], []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        if loc[:1] == ["prompt"] and len(loc) > 1:
            where, msg = "prompt", f"must be {PROMPT_FORMS}"
        parts.append(f"{where}: {msg}")
        params.append(loc[0] if loc else None)
    uniq = list(dict.fromkeys(parts))
    return "; ".join(uniq[:6]) + (f"; … ({len(uniq) - 6} more)" if len(uniq) > 6 else ""), (params[0] if params else None)


def _json_invalid(reason: str) -> RequestInvalid:
    return RequestInvalid(400, f"the request body is not valid JSON ({reason}); send a JSON object",
                          code="json_invalid")


def parse_body(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The request as ``model``, or ``RequestInvalid`` (400 ``json_invalid`` / 422 ``invalid_field``) with the reason."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        if errors[0].get("type") != "json_invalid":
            message, param = describe_validation(errors)
            raise RequestInvalid(422, message, code="invalid_field", param=param) from None
        reason = str(errors[0].get("msg", "")).removeprefix("Invalid JSON: ")
    # pydantic's parser refuses lone UTF-16 surrogates ("\ud800"), which JSON's grammar allows: the standard
    # parser decides whether this is JSON at all, and the schema then says what is wrong with the text.
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # bad syntax, invalid UTF-8 (UnicodeDecodeError), too deep
        raise _json_invalid(reason) from None
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        message, param = describe_validation(exc.errors())
        raise RequestInvalid(422, message, code="invalid_field", param=param) from None


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestInvalid)
    async def _invalid_body(request: Request, exc: RequestInvalid):
        return error_response(exc.status, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = describe_validation(exc.errors())
        return error_response(422, message, param=param, code="invalid_field")

    @app.exception_handler(ServeError)
    async def _serve(request: Request, exc: ServeError):
        return serve_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        # keeps the exception's headers: a 405 names the allowed methods (Allow)
        return error_response(exc.status_code, str(exc.detail), type="http_error", headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def _error_doc(description: str, *, retry_after: bool = False) -> dict:
    doc: dict = {"model": ErrorResponse, "description": description}
    if retry_after:
        doc["headers"] = {"Retry-After": {"description": "seconds to wait before retrying",
                                          "schema": {"type": "integer"}}}
    return doc


#: OpenAPI ``responses`` entries, by status: each route lists the ones it can return.
ERROR_DOCS = {
    400: _error_doc("body is not JSON (code json_invalid), or the model cannot take the prompt"),
    404: _error_doc("the model named in the request is not served here"),
    408: _error_doc("the request body did not arrive within the body timeout"),
    413: _error_doc("the request body is larger than --max-body-bytes"),
    422: _error_doc("the body does not follow the schema"),
    429: _error_doc("the request queue is full", retry_after=True),
    500: _error_doc("a forward failed on a rank"),
    503: _error_doc("not ready, draining, failing, or the rank serving the request died", retry_after=True),
}


def error_docs(*statuses: int) -> dict:
    return {s: ERROR_DOCS[s] for s in statuses}
