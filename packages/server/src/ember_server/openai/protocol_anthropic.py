"""Request and response models of Anthropic's Messages API (``POST /v1/messages``), and the
request's translation into a chat completion request (the one owner of the chat template, the
sampling fields and forced tool calls).

Requests are validated as strictly as the OpenAI routes' (``OpenAIRequest``): a wrongly typed
field is a 400 naming it; unknown fields are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ember_server.openai.protocol import Int64, JSONObject, OpenAIRequest, OpenAIResponse, Text
from ember_server.openai.protocol_chat import ChatCompletionRequest
from ember_server.openai.protocol_sampling import StructuredOutputsField


class TextBlock(OpenAIRequest):
    type: Literal["text"]
    text: Text


class ToolUseBlock(OpenAIRequest):
    """A call the assistant made, in the conversation's history."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JSONObject


class ToolResultBlock(OpenAIRequest):
    """What a call returned, sent back in a user turn."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(OpenAIRequest):
    """Thinking an earlier answer held, sent back by the client; left out of the prompt (as
    chat templates leave out earlier turns' reasoning)."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class AnthropicMessage(OpenAIRequest):
    """One turn: user turns hold text and tool results, assistant turns text and tool uses."""

    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]

    @model_validator(mode="after")
    def _check_blocks(self):
        if isinstance(self.content, str):
            return self
        misplaced = "tool_use" if self.role == "user" else "tool_result"
        if any(block.type == misplaced for block in self.content):
            raise ValueError(f"messages: a {self.role} message cannot hold {misplaced} blocks")
        return self

    def to_chat(self) -> list[dict[str, Any]]:
        """The turn as chat messages: tool results become ``tool`` messages (before the turn's
        text), tool uses the assistant message's ``tool_calls``."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        texts = [block.text for block in self.content if block.type == "text"]
        messages: list[dict[str, Any]] = [
            {"role": "tool", "content": block.text(), "tool_call_id": block.tool_use_id}
            for block in self.content
            if block.type == "tool_result"
        ]
        calls = [
            {
                "id": block.id,
                "type": "function",
                "function": {"name": block.name, "arguments": json.dumps(block.input)},
            }
            for block in self.content
            if block.type == "tool_use"
        ]
        if texts or calls or not messages:
            message: dict[str, Any] = {"role": self.role, "content": "".join(texts)}
            if calls:
                message["tool_calls"] = calls
            messages.append(message)
        return messages


class AnthropicTool(OpenAIRequest):
    name: Text
    description: Text | None = None
    input_schema: JSONObject


class AnthropicToolChoice(OpenAIRequest):
    """``auto``, ``any`` (some tool must be called), ``tool`` (the one named) or ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _check_name(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice.name must be given exactly when its type is tool")
        return self

    def to_chat(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"any": "required"}.get(self.type, self.type)


class AnthropicMetadata(OpenAIRequest):
    user_id: Text | None = None


class MessagesRequestBase(OpenAIRequest):
    """What ``/v1/messages`` and ``/v1/messages/count_tokens`` share: the prompt."""

    model: Text
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion fields of the prompt."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system
            if not isinstance(system, str):
                system = "".join(block.text for block in system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages.extend(message.to_chat())
        fields: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    },
                }
                for tool in self.tools
            ]
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.to_chat()
        return fields

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion request this request amounts to; its ValidationError names the
        chat field (``tool_choice``, ``messages``, ...), which is the Anthropic field too."""
        fields = {key: value for key, value in self.chat_fields().items() if value is not None}
        return ChatCompletionRequest.model_validate(fields, strict=False)


class CountTokensRequest(MessagesRequestBase):
    """Body of ``POST /v1/messages/count_tokens``."""


class MessagesRequest(MessagesRequestBase):
    """Body of ``POST /v1/messages``; ``structured_outputs`` is vLLM's extra field."""

    max_tokens: Int64 = Field(ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    stop_sequences: list[Text] | None = None
    stream: bool = False
    metadata: AnthropicMetadata | None = None
    structured_outputs: StructuredOutputsField | None = None

    def chat_fields(self) -> dict[str, Any]:
        fields = super().chat_fields()
        fields.update(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            stream=self.stream,
            structured_outputs=self.structured_outputs,
        )
        if self.metadata is not None:
            fields["user"] = self.metadata.user_id
        return fields


class AnthropicUsage(OpenAIResponse):
    """Token counts; ``input_tokens`` are the prompt tokens not read from the prefix cache."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class ResponseTextBlock(OpenAIResponse):
    type: Literal["text"] = "text"
    text: str


class ResponseThinkingBlock(OpenAIResponse):
    """The model's thinking (``--reasoning-parser``); unsigned, so a client sending it back
    gets no verification."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ResponseToolUseBlock(OpenAIResponse):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MessagesResponse(OpenAIResponse):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseThinkingBlock | ResponseTextBlock | ResponseToolUseBlock]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class CountTokensResponse(OpenAIResponse):
    input_tokens: int
