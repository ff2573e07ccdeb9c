"""The API key check: a 401 with an OpenAI error body unless ``Authorization: Bearer <key>``
(or Anthropic's ``x-api-key: <key>``).

A plain ASGI middleware: FastAPI's ``@app.middleware("http")`` (Starlette's BaseHTTPMiddleware)
relays every response body chunk through a memory stream and a task group, a cost per streamed
chunk that this one does not add.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from ember_server.openai.errors import error_response

# Paths any client may read without the key (probes and scrapers), as vLLM's server allows.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


class APIKeyMiddleware:
    """Refuses HTTP requests without the bearer ``api_key`` (``OPEN_PATHS`` and CORS preflight
    ``OPTIONS`` requests pass); compares in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._allowed(scope):
            response = error_response("Invalid or missing API key.", 401, None, scope["path"])
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            return True
        headers = dict(scope["headers"])
        bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
        key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)
        return bearer or key
