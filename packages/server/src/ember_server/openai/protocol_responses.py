"""Request models of OpenAI's Responses API (``POST /v1/responses``), and the request's
translation into the chat messages and chat completion fields it amounts to (the chat route
owns the chat template, sampling fields, forced tool calls and ``response_format``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from ember_server.openai.protocol import Int64, JSONObject, OpenAIRequest, Text
from ember_server.openai.protocol_sampling import StructuredOutputsField


class InputText(OpenAIRequest):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class MessageItem(OpenAIRequest):
    """A message of the conversation (``type`` may be left out, as clients do)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]

    def to_chat(self) -> dict[str, Any]:
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class FunctionCallItem(OpenAIRequest):
    """A call the model made earlier, sent back with the conversation."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(OpenAIRequest):
    """What a call returned."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text
    id: Text | None = None
    status: Text | None = None


class ReasoningItem(OpenAIRequest):
    """Earlier reasoning sent back; left out of the prompt (templates drop past thinking)."""

    type: Literal["reasoning"]


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]


def _item(value: Any) -> Any:
    """A message item may come without its ``type``: it is a message then."""
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return {**value, "type": "message"}
    return value


class FunctionTool(OpenAIRequest):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIRequest):
    type: Literal["function"]
    name: Text


class TextFormat(OpenAIRequest):
    """``text.format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(OpenAIRequest):
    format: TextFormat | None = None


class ResponsesRequest(OpenAIRequest):
    """Body of ``POST /v1/responses``."""

    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionChoice | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[str, Text] | None = None
    user: Text | None = None
    parallel_tool_calls: bool | None = None
    structured_outputs: StructuredOutputsField | None = None  # vLLM's extra field

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [_item(value) for value in data["input"]]}
        return data

    def input_messages(self) -> list[dict[str, Any]]:
        """The request's own input as chat messages (without instructions or history)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if item.type == "message":
                messages.append(item.to_chat())
            elif item.type == "function_call":
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif item.type == "function_call_output":
                messages.append(
                    {"role": "tool", "content": item.output, "tool_call_id": item.call_id}
                )
        return messages

    def chat_fields(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat completion request's fields for ``messages`` (history and input)."""
        if self.instructions is not None:
            messages = [{"role": "system", "content": self.instructions}, *messages]
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "structured_outputs": self.structured_outputs,
        }
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": tool.model_dump(exclude={"type"}, exclude_none=True),
                }
                for tool in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunctionChoice):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        else:
            fields["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            schema = {"name": fmt.name or "output", "schema": fmt.schema_ or {"type": "object"}}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt is not None:
            fields["response_format"] = {"type": fmt.type}
        return {key: value for key, value in fields.items() if value is not None}
