"""Request and response models of ``POST /v1/chat/completions``: messages, tools, tool calls."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field, model_validator

from ember_scheduler.sampling_params import MAX_LOGPROBS, SamplingParams
from ember_server.openai.protocol import (
    Int64,
    JSONObject,
    OpenAIRequest,
    OpenAIResponse,
    Text,
    UsageInfo,
    random_id,
)
from ember_server.openai.protocol_sampling import SamplingFields

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class TextContentPart(OpenAIRequest):
    """A text part of a message's content list."""

    type: Literal["text"]
    text: Text


class AssistantFunctionCall(OpenAIRequest):
    name: Text
    arguments: Text


class AssistantToolCall(OpenAIRequest):
    """A tool call the assistant made, in a conversation's history."""

    id: Text
    type: Literal["function"]
    function: AssistantFunctionCall


class ChatMessage(OpenAIRequest):
    """One message of a chat, with OpenAI's roles and the fields each needs.

    ``system``, ``developer``, ``user`` and ``tool`` messages need content; an ``assistant``
    message needs content or ``tool_calls``; a ``tool`` message needs ``tool_call_id``. Content
    parts other than text are not supported.
    """

    role: Literal[CHAT_ROLES]
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _check_role_fields(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            needs = "content or tool_calls" if self.role == "assistant" else "content"
            raise ValueError(f"a {self.role} message needs {needs} (a string or text parts)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role}")
        if (self.tool_call_id is None) == (self.role == "tool"):
            raise ValueError("tool_call_id is required in tool messages and only there")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates take it: role, content text, and any tool fields."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(OpenAIRequest):
    name: Text
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class ChatTool(OpenAIRequest):
    """One entry of ``tools``: a function the model may call."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIRequest):
    name: Text


class NamedToolChoice(OpenAIRequest):
    """``tool_choice`` naming the function to call."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: JSONObject | None = None

    @model_validator(mode="after")
    def _check_tools(self):
        if not self.forces_tool_call:
            return self
        if not self.tools:
            raise ValueError("tool_choice required or a named function needs tools")
        if self._structured_outputs is not None:
            raise ValueError(
                "tool_choice required or a named function excludes response_format and "
                "structured_outputs"
            )
        self.constrain("tools", json=self.tool_call_schema(), disable_any_whitespace=True)
        return self

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def forced_function(self) -> str | None:
        """The function ``tool_choice`` names, if it names one."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.function.name
        return None

    def tool_call_schema(self) -> dict[str, Any]:
        """The JSON schema a forced call's output matches: the named function's parameters, or
        (``required``) an object ``{"name", "arguments"}`` for any one of the tools."""
        name = self.forced_function
        if name is not None:
            for tool in self.tools:
                if tool.function.name == name:
                    return _parameters(tool)
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")
        return {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool.function.name},
                        "arguments": _parameters(tool),
                    },
                    "required": ["name", "arguments"],
                }
                for tool in self.tools
            ]
        }

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def conversation(self) -> list[dict[str, Any]]:
        return [m.to_template() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (None when none, or tool_choice is none)."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object"}


class ChatTopLogprob(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIResponse):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIResponse):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIResponse):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIResponse):
    role: str
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: the model's thinking


class ChatCompletionResponseChoice(OpenAIResponse):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaFunctionCall(OpenAIResponse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIResponse):
    """A piece of a streamed tool call: the first piece of call ``index`` carries its id and
    name, later ones more of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIResponse):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None


class ChatCompletionResponseStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
