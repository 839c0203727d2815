"""Every error leaves the server in OpenAI's shape, never as a bare 500 or a 422.

`{"error": {"message", "type", "param", "code"}}`; clients (the `openai` package
included) read `param` to point at the offending field, so validation errors name it.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from policies.config import KVPolicyError
from scheduler.async_engine import EngineError, EngineUnavailable, QueueFull
from scheduler.outputs import RequestRejected

logger = logging.getLogger("kvserve.server")


class APIError(Exception):
    """Raised anywhere in a handler to answer with an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code),
                        status_code=err.status, headers=err.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    # pydantic puts union branch names ("list[int]", "constrained-str", "str") in loc
    parts = [p for p in parts if p.isdigit() or (_IDENT.fullmatch(p) and p not in _TYPE_NAMES)]
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """`param` is the most specific location (for a union, the branch that got furthest,
    e.g. `prompt.1` for `[5, -1]`); the message lists the errors (bounded)."""
    if not errors:
        return bad_request("invalid request")
    params = [_loc_to_param(e.get("loc", ())) for e in errors]
    msgs = [f"{p}: {e.get('msg')}" if p else str(e.get("msg"))
            for p, e in zip(params[:5], errors[:5])]

    def rank(i: int) -> tuple[bool, int, int]:  # a real violation beats a union type miss
        return (not str(errors[i].get("type", "")).endswith("_type"),
                len((params[i] or "").split(".")), -i)

    best = max(range(len(params)), key=rank)
    return bad_request("; ".join(msgs), params[best])


def map_exception(exc: BaseException) -> APIError | None:
    """Engine and validation exceptions -> the HTTP error they mean (None: a bug)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(exc.retry_after)})
    if isinstance(exc, RequestRejected):
        return bad_request(str(exc), exc.param, "context_length_exceeded"
                           if exc.param in ("max_tokens", "prompt", "messages") else None)
    if isinstance(exc, KVPolicyError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, EngineUnavailable):
        return APIError(503, str(exc), type="service_unavailable", code=exc.reason,
                        headers={"Retry-After": "5"})
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors())
    if isinstance(exc, EngineError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    return None


_STATUS_TYPES = {401: ("invalid_request_error", "invalid_api_key"),
                 404: ("invalid_request_error", "not_found"),
                 405: ("invalid_request_error", "method_not_allowed"),
                 413: ("invalid_request_error", "request_too_large")}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_, code = _STATUS_TYPES.get(exc.status_code, (
            "invalid_request_error" if exc.status_code < 500 else "server_error", None))
        err = APIError(exc.status_code, str(exc.detail), type=type_, code=code,
                       headers=getattr(exc, "headers", None))
        return error_response(err)

    async def _mapped(_: Request, exc: Exception) -> JSONResponse:
        mapped = map_exception(exc)
        assert mapped is not None
        return error_response(mapped)

    # Registered per class so ExceptionMiddleware answers them; the catch-all below runs
    # in ServerErrorMiddleware, which re-raises after responding (and drops the socket).
    for cls in (QueueFull, RequestRejected, KVPolicyError, EngineUnavailable,
                ValidationError, EngineError):
        app.add_exception_handler(cls, _mapped)

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        mapped = map_exception(exc)
        if mapped is not None:
            return error_response(mapped)
        logger.exception("unhandled error")
        return error_response(APIError(500, "internal server error", type="server_error"))
