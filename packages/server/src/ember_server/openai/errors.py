"""Errors in the OpenAI error format, and the handlers that turn every failure into one.

Bad input is always a 4xx with ``{"error": {"message", "type", "param", "code"}}``: malformed
JSON and wrongly typed or missing fields (400), a bad API key (401), an unknown model or route
(404), a body over the size limit (413), headers over theirs (431). A dead or stopping engine, or a
full waiting queue, is a 503 (the latter with ``Retry-After``). Only a bug in Ember
itself is a 500.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember_server.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# SamplingParams and the engine name the offending field as "SamplingParams.<field> ...".
_FIELD_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")
# Union members appear in validation locations as type or model names ("str", "list[int]",
# "function-after[...]", "TokenizeChatRequest"): they are not fields.
_UNION_MEMBER = re.compile(r"[a-z_-]+\[.*\]|str|int|float|bool|[A-Z][A-Za-z]*")


class OpenAIError(Exception):
    """A failure to report to the client with an HTTP status and, where known, the field."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers  # e.g. Retry-After of a 503


def error_body(message: str, status: int, param: str | None = None) -> ErrorResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


ErrorShape = Callable[[str, int, str | None], JSONResponse]
# Routes whose API has its own error format (Anthropic's), by path prefix.
_ERROR_SHAPES: dict[str, ErrorShape] = {}


def register_error_shape(path_prefix: str, shape: ErrorShape) -> None:
    """Answer errors of the routes under ``path_prefix`` with ``shape(message, status, param)``."""
    _ERROR_SHAPES[path_prefix] = shape


def error_response(
    message: str,
    status: int,
    param: str | None = None,
    path: str = "",
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error response of the route at ``path``: OpenAI's format unless it has its own;
    ``headers`` (e.g. a 503's Retry-After) go with either."""
    for prefix, shape in _ERROR_SHAPES.items():
        if path.startswith(prefix):
            response = shape(message, status, param)
            response.headers.update(headers or {})
            return response
    body = error_body(message, status, param)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def from_value_error(exc: ValueError) -> OpenAIError:
    """A 400 for bad values found after parsing (sampling ranges, prompt length, ...)."""
    message = str(exc)
    match = _FIELD_IN_MESSAGE.search(message)
    return OpenAIError(message, 400, match.group(1) if match else None)


def from_validation_error(exc) -> OpenAIError:
    """A 400 for a request model a route builds itself (the chat request an Anthropic or
    Responses request amounts to) that does not validate (a pydantic ValidationError)."""
    message, param = _describe_validation(RequestValidationError(exc.errors()))
    return OpenAIError(message, 400, param)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable message (and the first field) from FastAPI's validation errors."""
    parts: list[str] = []
    param: str | None = None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", "")
            return f"Malformed JSON body: {detail}".rstrip(": "), None
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        fields = [p for p in loc if not _UNION_MEMBER.fullmatch(p)]
        field = ".".join(fields)
        message = err.get("msg", "invalid value")
        if err.get("type") == "value_error":
            # A model validator's message starts with the field it is about.
            message = message.removeprefix("Value error, ")
            if not field:
                field_word = re.match(r"[a-z_]+", message)
                param = param or (field_word.group(0) if field_word else None)
                parts.append(message)
                continue
        if param is None and field:
            param = field
        if err.get("type") == "missing" and not field:
            message = "a JSON object body is required"
        parts.append(f"{field}: {message}" if field else message)
    unique = list(dict.fromkeys(parts))
    return "; ".join(unique) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception raised while serving to an OpenAI-format error response."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return error_response(message, 400, param, request.url.path)

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, request.url.path, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's detail defaults to the status phrase ("Not Found").
        return error_response(str(exc.detail), exc.status_code, None, request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving a request")
        message = f"internal server error: {type(exc).__name__}"
        return error_response(message, 500, None, request.url.path)
