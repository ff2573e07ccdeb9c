"""The routes of the APIs agents call beside OpenAI's chat: Anthropic's Messages
(``/v1/messages``, ``/v1/messages/count_tokens``), registered on the app by ``build_app``."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember_server.openai.errors import register_error_shape
from ember_server.openai.protocol_anthropic import CountTokensRequest, MessagesRequest
from ember_server.openai.serving_anthropic import (
    AnthropicServingMessages,
    anthropic_error_response,
)
from ember_server.openai.serving_chat import OpenAIServingChat

MESSAGES_PATH = "/v1/messages"


def add_agent_routes(app: FastAPI, chat: OpenAIServingChat) -> None:
    """Serve the agent APIs on ``app`` through the chat route's handler ``chat``."""
    messages = AnthropicServingMessages(chat)
    register_error_shape(MESSAGES_PATH, anthropic_error_response)

    @app.post(MESSAGES_PATH)
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create_message(request, raw_request)

    @app.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(request: CountTokensRequest) -> JSONResponse:
        return await messages.count_tokens(request)
