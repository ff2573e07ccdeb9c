"""The FastAPI app of ``ember serve`` and the coroutine that runs it with uvicorn.

Routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/classify``,
``/score``, ``/rerank`` (also ``/v1/score``, ``/v1/rerank``), ``/v1/models``, ``/tokenize``,
``/detokenize``, ``/health`` (503 once the engine has failed; with data parallelism, each
engine core's state, and 503 once none is left), ``/version`` and ``/metrics``.
A ``generate`` engine answers the pooling routes too (embeddings of its decoder); a ``pooling``
engine answers the generation routes with a 400.
With an API key every route except ``/health``, ``/version`` and ``/metrics`` needs
``Authorization: Bearer <key>`` (401 otherwise).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import ember_server
from ember_server.engine_args import EngineArgs
from ember_server.metrics import CONTENT_TYPE
from ember_server.openai.errors import error_response, install_error_handlers
from ember_server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from ember_server.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from ember_server.openai.serving import OpenAIServing
from ember_server.openai.serving_chat import OpenAIServingChat
from ember_server.openai.serving_completion import OpenAIServingCompletion
from ember_server.openai.serving_pooling import OpenAIServingPooling

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})


def build_app(engine, api_key: str | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (a started ``AsyncLLM``);
    ``tool_call_parser`` parses tool calls out of text (``tool_choice`` auto)."""
    app = FastAPI(title="Ember OpenAI-compatible server", version=ember_server.__version__)
    install_error_handlers(app)
    completions = OpenAIServingCompletion(engine)
    chat = OpenAIServingChat(engine, tool_call_parser)
    common = OpenAIServing(engine)
    pooling = OpenAIServingPooling(engine)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def _check_api_key(request: Request, call_next: Callable[..., Awaitable[Response]]):
            if request.method != "OPTIONS" and request.url.path not in OPEN_PATHS:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return error_response("Invalid or missing API key.", 401)
            return await call_next(request)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await pooling.create_embedding(request, raw_request)

    @app.post("/classify")
    async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
        return await pooling.create_classify(request, raw_request)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return await pooling.create_score(request, raw_request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    async def create_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return await pooling.create_rerank(request, raw_request)

    @app.get("/v1/models")
    async def show_models() -> JSONResponse:
        card = ModelCard(
            id=common.model_name, root=engine.model_config.model, max_model_len=common.max_model_len
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        common.check_request(request)
        if isinstance(request, TokenizeChatRequest):
            tokens = common.encode_chat(request)
        else:
            tokens = common.encode(request.prompt, request.add_special_tokens)
        body = TokenizeResponse(
            count=len(tokens), max_model_len=common.max_model_len, tokens=tokens
        )
        return JSONResponse(body.model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        common.check_request(request)
        common.check_token_ids(request.tokens, "tokens")
        return JSONResponse(
            DetokenizeResponse(prompt=common.tokenizer.decode(request.tokens)).model_dump()
        )

    @app.get("/health")
    async def health() -> Response:
        common.check_engine()  # 503 once no engine core is left
        if len(engine.clients) == 1:
            return Response(status_code=200)
        # Data parallel: serving while any engine core lives; say which ones are dead.
        return JSONResponse({"engines": engine.engine_states()})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": ember_server.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def run_server(
    engine_args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    log_level: str = "info",
    tool_call_parser: str | None = None,
) -> None:
    """Start the engine core process, then serve until interrupted; always shut the engine down."""
    from ember_server.async_llm import AsyncLLM

    engine = await AsyncLLM.start(engine_args)
    try:
        app = build_app(engine, api_key, tool_call_parser)
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5
        )
        logger.info("serving %s on http://%s:%d", engine.served_model_name, host, port)
        await uvicorn.Server(config).serve()
    finally:
        await engine.shutdown()
