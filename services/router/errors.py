"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Every error the router answers goes through here, including FastAPI's own (a body that
fails validation is a 400 here, not FastAPI's 422; an unknown route is a 404), so a client
never has to parse two error formats.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as one server-sent event, for a stream that already started."""
        return f"data: {json.dumps(self.body())}\n\n"


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(
        401,
        "missing or invalid API key: send 'Authorization: Bearer <key>'",
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"the model {name!r} does not exist; this server serves {served!r}",
        param="model",
        code="model_not_found",
    )


def too_many_requests(message: str) -> APIError:
    return APIError(
        429,
        message,
        type="rate_limit_error",
        code="rate_limit_exceeded",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def no_workers() -> APIError:
    return APIError(
        503,
        "no worker is available to serve this request; retry later",
        type="service_unavailable",
        code="no_workers",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def worker_error(message: str) -> APIError:
    return APIError(502, message, type="upstream_error", code="worker_error")


def internal_error() -> APIError:
    return APIError(500, "internal error in the router", type="internal_error")


def timeout_error(seconds: float) -> APIError:
    return APIError(504, f"request timed out after {seconds:g}s", type="timeout", code="timeout")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).response()


def validation_error(errors: Any) -> APIError:
    """The first of pydantic's validation errors, as a 400."""
    first = errors[0] if errors else {}
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('ctx', {}).get('error', kind)}")
    loc = _field_path(first, errors)
    if not loc:
        if kind == "missing":
            return bad_request("the request needs a JSON body")
        if kind == "value_error":  # a check of the whole body, e.g. its text's encoding
            return bad_request(str(first.get("msg", "")).removeprefix("Value error, "))
        return bad_request("the request body must be a JSON object")
    param = ".".join(loc)
    message = str(first.get("msg", "invalid value"))
    if any(e is not first and _loc(e)[:1] == loc[:1] for e in errors):
        message = f"no accepted form matches ({message})"
    return bad_request(f"{param}: {message}", param=param)


def _loc(error: Any) -> list[str]:
    return [str(part) for part in error.get("loc", ()) if part != "body"]


def _field_path(first: Any, errors: Any) -> list[str]:
    """The first error's field path. A value that fails every member of a union (a prompt
    that is neither text nor token ids) yields one error per member, whose paths end in
    the member's type name: their common prefix names the field."""
    path = _loc(first)
    for other in errors:
        other_path = _loc(other)
        if other is first or other_path[:1] != path[:1]:
            continue
        common = 0
        while common < min(len(path), len(other_path)) and path[common] == other_path[common]:
            common += 1
        path = path[:common]
    return path


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unexpected error serving %s", request.url.path, exc_info=exc)
    return internal_error().response()
