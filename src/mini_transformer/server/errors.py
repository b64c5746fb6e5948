"""Errors on their way out: every one an OpenAI error object with the right status and headers."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .protocol import REFUSED, ErrorResponse


def install_error_handlers(app: FastAPI, metrics) -> None:
    """Every error leaves as an OpenAI error object: ours, pydantic's (400 naming the top-level
    parameter), and Starlette's own (404, 405 with its Allow header)."""

    def reply(err: ErrorResponse) -> JSONResponse:
        metrics.rejected.labels(str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ErrorResponse)
    async def on_error(request, err: ErrorResponse):
        return reply(err)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, err: RequestValidationError):
        return reply(invalid_request(err.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request, err: StarletteHTTPException):
        return reply(ErrorResponse(err.status_code, str(err.detail), headers=err.headers))  # 405 keeps Allow


def invalid_request(errors) -> ErrorResponse:
    """pydantic's errors as one 400 naming the top-level parameter, as OpenAI names it (the rest of a
    location: union members). A known field this server cannot honour is named as such (protocol.REFUSED)."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", message)
        message, param = f"the body is not valid JSON: {reason}", None
        if "recursion limit" in reason:  # the parser's own depth limit: refused before anything recursed
            message = f"the body nests its arrays and objects too deeply to be read ({reason})"
    elif not loc:  # the body as a whole: not a JSON object
        message = f"the body must be a JSON object (Content-Type: application/json): {message}"
    elif param in REFUSED and len(loc) == 1:
        message = REFUSED[param]
    else:
        got = f" (got {_short(first['input'])})" if "input" in first else ""
        message = f"{'.'.join(loc)}: {message}{got}"
    return ErrorResponse(400, message, param=param)


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
