"""FastAPI routes whose JSON request bodies msgspec decodes.

FastAPI parses a JSON body with the standard library's ``json.loads`` before validating it, about
twice msgspec's time for a long prompt's token ids (msgspec is the front end's wire format
already). A body msgspec refuses goes to ``json.loads`` as before, so every
body decodes to what it did (``NaN``, lone surrogates, ``1e400``) or fails with the same error.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute


class MsgspecJSONRequest(Request):
    """A request whose ``json()`` decodes with msgspec, falling back to ``json.loads``."""

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = msgspec.json.decode(body)
            except msgspec.DecodeError:
                self._json = json.loads(body)
        return self._json


class MsgspecJSONRoute(APIRoute):
    """An ``APIRoute`` that hands its endpoint a ``MsgspecJSONRequest``."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            return await handler(MsgspecJSONRequest(request.scope, request.receive))

        return handle
