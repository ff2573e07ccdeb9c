"""The FastAPI app of ``ember serve`` and the coroutine that runs it with uvicorn.

Routes: ``/v1/completions``, ``/v1/chat/completions``, the agent APIs of ``agent_routes``
(Anthropic's ``/v1/messages``, OpenAI's ``/v1/responses``), ``/v1/embeddings``, ``/classify``,
``/score``, ``/rerank`` (also ``/v1/score``, ``/v1/rerank``), ``/v1/models``, ``/tokenize``,
``/detokenize``, ``/health`` (503 while no engine core is alive: failed, or restarting; with
data parallelism, each engine core's state), ``/version`` and ``/metrics``.
A ``generate`` engine answers the pooling routes too (embeddings of its decoder); a ``pooling``
engine answers the generation routes with a 400.
With an API key every route except ``/health``, ``/version`` and ``/metrics`` needs
``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import ember_server
from ember_server.engine.core_client import AsyncMPClient, EngineDeadError
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.metrics import CONTENT_TYPE
from ember_server.openai.agent_routes import add_agent_routes
from ember_server.openai.api_key import APIKeyMiddleware
from ember_server.openai.body_limit import BodyLimitMiddleware
from ember_server.openai.errors import OpenAIError, install_error_handlers
from ember_server.openai.json_route import MsgspecJSONRoute
from ember_server.openai.lora_routes import (
    adapter_cards,
    install_lora_routes,
    register_lora_modules,
)
from ember_server.openai.protocol import ModelCard, ModelList
from ember_server.openai.protocol_chat import ChatCompletionRequest
from ember_server.openai.protocol_completion import CompletionRequest
from ember_server.openai.protocol_pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from ember_server.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from ember_server.openai.serving import OpenAIServing
from ember_server.openai.serving_chat import OpenAIServingChat
from ember_server.openai.serving_completion import OpenAIServingCompletion
from ember_server.openai.serving_pooling import OpenAIServingPooling

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = 25.0  # below Kubernetes' default 30 s between SIGTERM and SIGKILL
# Bytes of body per token of context allowed by default: a prompt of max_model_len tokens as
# JSON (token ids, or text with every character \u-escaped) needs well under this.
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_LIMIT = 1024**2


def default_body_limit(max_model_len: int) -> int:
    """The request body limit when none is given: ample for a whole context, never below 1 MiB."""
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * max_model_len)


def build_app(
    engine,
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    max_body_size: int | None = None,
    lora_modules: dict[str, str] | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``engine`` (a started ``AsyncLLM``);
    ``tool_call_parser`` parses tool calls out of text (``tool_choice`` auto),
    ``reasoning_parser`` the model's thinking (``reasoning_content``).

    ``lora_modules`` (name -> PEFT folder) are served as models of their own (``lora_routes``).
    Bodies over ``max_body_size`` bytes (default: ``default_body_limit`` of the context length)
    get a 413 as soon as the Content-Length or the bytes received so far exceed it.
    """
    if max_body_size is None:
        max_body_size = default_body_limit(engine.model_config.max_model_len)
    app = FastAPI(title="Ember OpenAI-compatible server", version=ember_server.__version__)
    app.router.route_class = MsgspecJSONRoute
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_size)
    install_error_handlers(app)
    completions = OpenAIServingCompletion(engine)
    chat = OpenAIServingChat(engine, tool_call_parser, reasoning_parser)
    common = OpenAIServing(engine)
    pooling = OpenAIServingPooling(engine)
    register_lora_modules(engine, lora_modules)
    install_lora_routes(app, engine, common.model_name)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    add_agent_routes(app, chat)

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
        cards = [card, *adapter_cards(engine, common.model_name, common.max_model_len)]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        common.check_request(request)
        if isinstance(request, TokenizeChatRequest):
            tokens = await common.encode_chat(request)
        else:
            tokens = await common.encode(request.prompt, request.add_special_tokens)
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
        if not engine.is_healthy():  # none alive: failed, or every one restarting
            common.check_engine()
            raise OpenAIError("No engine core is alive; one is restarting.", 503)
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


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: ``run_server`` decides what a signal does (uvicorn's
    own re-raise the signal after serving, which kills the process before the engine stops)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def run_server(
    engine_args: EngineArgs,
    listener: socket.socket,
    engines: list[AsyncMPClient],
    *,
    api_key: str | None = None,
    log_level: str = "info",
    tool_call_parser: str | None = None,
    shutdown_timeout: float | None = None,
    max_body_size: int | None = None,
    lora_modules: dict[str, str] | None = None,
    reasoning_parser: str | None = None,
) -> int:
    """Serve on ``listener`` until SIGTERM/SIGINT or the engine's death; the exit status (0
    stopped, 1 engine died). ``engines`` are the engine core processes ``launch_engines``
    started for ``engine_args`` (the CLI starts them before importing this module).

    On the first signal the server stops accepting, lets requests in flight finish for up to
    ``shutdown_timeout`` seconds (default ``DEFAULT_SHUTDOWN_TIMEOUT``) and fails the rest with a
    503 (a second signal fails them at once). In every case the engine core processes are
    stopped and their socket folders removed.
    """
    from ember_server.engine.async_llm import AsyncLLM

    if shutdown_timeout is None:
        shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT

    loop = asyncio.get_running_loop()
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    engine = None
    try:
        # A signal while the model loads stops the start-up (engine process and socket folder
        # included) instead of killing this process midway.
        starting = asyncio.ensure_future(AsyncLLM.start(engine_args, clients=engines))
        stop = asyncio.ensure_future(signals.get())
        await asyncio.wait({starting, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            logger.info("%s during start-up: stopping", stop.result().name)
            starting.cancel()
            await asyncio.wait({starting})
            return 0
        stop.cancel()
        engine = starting.result()
        app = build_app(
            engine,
            api_key,
            tool_call_parser,
            max_body_size,
            lora_modules=lora_modules,
            reasoning_parser=reasoning_parser,
        )
        # Start-up objects (transformers, the tokenizer, FastAPI: ~390k) live as long as the
        # server: frozen, a full collection no longer scans them (such a scan stalls a stream).
        gc.collect()
        gc.freeze()
        # uvicorn's own wait is only the backstop: draining below ends every request in time.
        config = uvicorn.Config(
            app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + 5
        )
        server = _Server(config)
        serving = asyncio.ensure_future(server.serve(sockets=[listener]))
        host, port = listener.getsockname()[:2]
        logger.info("serving %s on http://%s:%d", engine.served_model_name, host, port)
        stop = asyncio.ensure_future(signals.get())
        died = asyncio.ensure_future(engine.wait_until_dead())
        await asyncio.wait({serving, stop, died}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        status = 0
        if stop.done():
            await _drain(engine, stop.result(), signals, shutdown_timeout)
        elif died.done():
            logger.error("the engine core died: stopping the server (exit status 1) for a restart")
            status = 1
        stop.cancel()
        died.cancel()
        await serving
        return status
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        listener.close()
        if engine is not None:
            await engine.shutdown()


async def _drain(engine, sig: signal.Signals, signals: asyncio.Queue, timeout: float) -> None:
    """Give the requests in flight ``timeout`` seconds (or until the next signal), then fail them."""
    logger.info(
        "%s: shutting down; %d requests in flight get up to %.0f s to finish (signal again to "
        "stop them now)",
        sig.name,
        engine.num_requests_in_flight,
        timeout,
    )
    again = asyncio.ensure_future(signals.get())
    idle = asyncio.ensure_future(engine.wait_until_idle())
    await asyncio.wait({again, idle}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    idle.cancel()
    if engine.num_requests_in_flight:
        logger.warning("failing %d unfinished requests", engine.num_requests_in_flight)
    engine.fail_requests(
        EngineDeadError(f"the server is shutting down ({sig.name}); the request did not finish")
    )
