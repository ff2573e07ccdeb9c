"""The routes of the APIs agents call beside OpenAI's chat: Anthropic's Messages
(``/v1/messages``, ``/v1/messages/count_tokens``) and OpenAI's Responses (``/v1/responses``,
``GET /v1/responses/{id}``), registered on the app by ``build_app``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember_server.openai.errors import register_error_shape
from ember_server.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from ember_server.openai.protocol_responses import ResponsesRequest
from ember_server.openai.serving_anthropic import (
    AnthropicServingMessages,
    anthropic_error_response,
)
from ember_server.openai.serving_chat import OpenAIServingChat
from ember_server.openai.serving_responses import OpenAIServingResponses

MESSAGES_PATH = "/v1/messages"


def add_agent_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    """Serve the agent APIs on ``app`` through the chat route's handler ``chat``."""
    messages = AnthropicServingMessages(chat)
    responses = OpenAIServingResponses(chat)
    register_error_shape(MESSAGES_PATH, anthropic_error_response)

    @app.post(MESSAGES_PATH)
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create_message(request, raw_request)

    @app.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(request: CountTokensRequest) -> JSONResponse:
        return await messages.count_tokens(request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> JSONResponse:
        responses.chat.check_engine()
        return responses.retrieve(response_id)
