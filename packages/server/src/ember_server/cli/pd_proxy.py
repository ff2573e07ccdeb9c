"""``ember proxy``: prefill/decode disaggregation in front of two Ember servers.

For each OpenAI completion or chat request the proxy first sends it to the prefill instance
(a ``kv_producer``) with ``max_tokens`` 1 and no streaming, which computes the prompt's KV and
saves it to the shared tier; then it sends the original request to the decode instance (a
``kv_consumer``), which loads that KV instead of computing it, and streams (or returns) its
answer to the client. An error from either instance goes back to the client as it came.
"""

from __future__ import annotations

import contextlib
import logging

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ember_server.openai.errors import error_response

logger = logging.getLogger(__name__)
_ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_request(body: dict) -> dict:
    """The request as the prefill instance gets it: one token, no stream."""
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill["max_tokens"] = 1
    prefill.pop("max_completion_tokens", None)
    prefill["n"] = 1
    return prefill


def build_proxy_app(prefill_url: str, decode_url: str, timeout: float = 600.0) -> FastAPI:
    """The proxy's app over a prefill and a decode server's base URLs."""
    client = httpx.AsyncClient(timeout=timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await client.aclose()

    app = FastAPI(title="Ember prefill/decode proxy", lifespan=lifespan)

    async def forward(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response("request body is not valid JSON", 400)
        if not isinstance(body, dict):
            return error_response("request body must be a JSON object", 400)
        path = request.url.path
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        try:
            prefill = await client.post(
                prefill_url + path, json=prefill_request(body), headers=headers
            )
            if prefill.status_code != 200:
                return Response(prefill.content, prefill.status_code, media_type="application/json")
            if not body.get("stream"):
                decode = await client.post(decode_url + path, json=body, headers=headers)
                return Response(decode.content, decode.status_code, media_type="application/json")
            decode_request = client.build_request(
                "POST", decode_url + path, json=body, headers=headers
            )
            decode = await client.send(decode_request, stream=True)
        except httpx.HTTPError as exc:
            return error_response(f"prefill/decode instance unreachable: {exc}", 503)
        if decode.status_code != 200:
            content = await decode.aread()
            await decode.aclose()
            return Response(content, decode.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in decode.aiter_raw():
                    yield chunk
            finally:
                await decode.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    for route in _ROUTES:
        app.add_api_route(route, forward, methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        reply = await client.get(decode_url + "/v1/models")
        return Response(reply.content, reply.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"prefill": prefill_url, "decode": decode_url})

    return app


async def run_proxy(prefill_url: str, decode_url: str, host: str, port: int) -> None:
    app = build_proxy_app(prefill_url.rstrip("/"), decode_url.rstrip("/"))
    logger.info("proxy on http://%s:%d: prefill %s, decode %s", host, port, prefill_url, decode_url)
    await uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning")).serve()
