"""Request and response models of ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag

from ember_server.openai.protocol import JSONObject, OpenAIRequest, OpenAIResponse, Text
from ember_server.openai.protocol_chat import ChatMessage


class TokenizeCompletionRequest(OpenAIRequest):
    """Body of ``POST /tokenize`` for a plain prompt."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeChatRequest(OpenAIRequest):
    """Body of ``POST /tokenize`` for chat messages, rendered through the chat template."""

    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JSONObject | None = None

    def conversation(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]


def _tokenize_kind(body: Any) -> str:
    return "TokenizeChatRequest" if isinstance(body, dict) and "messages" in body else "Prompt"


# A body with messages is a chat request (its errors are about messages, not a missing prompt).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("Prompt")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_kind),
]


class DetokenizeRequest(OpenAIRequest):
    """Body of ``POST /detokenize``."""

    model: Text | None = None
    tokens: list[int]


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIResponse):
    prompt: str
