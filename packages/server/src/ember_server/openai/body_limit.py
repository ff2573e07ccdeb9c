"""The request size limits: a 413 for a body, a 431 for headers, with an OpenAI error body,
decided before the body is read whole.

FastAPI's own ``max_body_size`` answers a declared oversize body with plain text, so the limit is
this small ASGI middleware instead: a Content-Length over the limit is refused before any of the
body is read, and a body without one (chunked) is counted as it arrives and refused the moment it
passes the limit. The rest is never read, so a huge body costs neither memory nor time. Headers
over ``MAX_HEADER_BYTES`` in all (names and values) get a 431 before the app sees the request:
the HTTP parser accepts any size, and every header is held in memory for the request's life.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ember_server.openai.errors import error_response

MAX_HEADER_BYTES = 64 * 1024


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes the limit (the app's error handler answers)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"The request body is larger than this server's limit of {limit} bytes "
            "(ember serve --max-request-body-size).",
        )


class BodyLimitMiddleware:
    """Refuses HTTP request bodies over ``max_bytes`` with a 413, and requests whose headers
    pass ``max_header_bytes`` in all with a 431."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, max_header_bytes: int = MAX_HEADER_BYTES
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(name) + len(value) for name, value in scope["headers"])
        if header_bytes > self.max_header_bytes:
            message = (
                f"The request headers hold {header_bytes} bytes, over this server's limit of "
                f"{self.max_header_bytes} bytes."
            )
            await error_response(message, 431, None, scope["path"])(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            too_large = BodyTooLarge(self.max_bytes)
            await error_response(too_large.detail, 413, None, scope["path"])(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)
