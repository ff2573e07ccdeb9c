"""Request and response models of the OpenAI API, with its field names and vLLM's extra fields.

Requests are validated strictly (a string is not an integer, ``true`` is not a number) so that a
wrongly typed field is a 400 naming the field, never a silent coercion. Unknown fields are accepted
and ignored, as OpenAI clients send fields a server may not know; ``ignored_fields`` lists them.
Range checks of sampling values live in ``ember_scheduler.SamplingParams`` (one source of truth);
``to_sampling_params`` raises its ValueError, which the server answers with a 400.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    model_validator,
)

from ember_scheduler.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams

MAX_N = 128  # OpenAI's limit on choices per request
# Integers travel to the engine core as msgpack int64: larger ones are a 400, not a crash.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# JSON's \ud800-style escapes can carry half of a UTF-16 pair alone: not text any tokenizer takes.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(value: Any) -> Any:
    """``value`` (a string, or strings nested in lists and dicts) if it holds no lone surrogate."""
    if isinstance(value, str):
        match = _SURROGATE.search(value)
        if match is not None:
            raise ValueError(
                f"holds a lone UTF-16 surrogate (U+{ord(match.group()):04X}) at character "
                f"{match.start()}: text must be valid Unicode"
            )
    elif isinstance(value, list):
        for item in value:
            _valid_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _valid_unicode(key)
            _valid_unicode(item)
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
JSONObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode)]
# One prompt's token ids, a list of those, a string, or a list of strings. Token ids come first:
# pydantic tries the members in order, and a string member tried first against 1,500 token ids
# builds an error per id (220 µs per request against 12).
PromptInput = list[int] | list[list[int]] | Text | list[Text]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIRequest(BaseModel):
    """Base of request models: strict types, unknown fields kept aside and ignored."""

    model_config = ConfigDict(strict=True, extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class OpenAIResponse(BaseModel):
    """Base of response models."""

    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIRequest):
    """``stream_options`` of a streaming request."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIRequest):
    """``response_format.json_schema``: a named JSON schema."""

    name: Text
    description: Text | None = None
    schema_: JSONObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    """``response_format``: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError(
                "response_format.json_schema must be given exactly when its type is json_schema"
            )
        return self


class StructuredOutputsField(OpenAIRequest):
    """vLLM's extra ``structured_outputs``: one of json, json_object, regex, choice, grammar."""

    json_: JSONObject | Text | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    disable_any_whitespace: bool = False


def _checked_spec(field: str, **spec) -> StructuredOutputsParams:
    """The spec, checked to compile now; a ValueError starting with ``field`` when it does not."""
    from ember_worker.structured_outputs import check_structured_outputs

    try:
        params = StructuredOutputsParams(**spec)
        check_structured_outputs(params)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None
    return params


class _SamplingFields(OpenAIRequest):
    """Sampling fields shared by completions and chat completions (OpenAI's and vLLM's)."""

    model: Text | None = None
    n: Annotated[int, Field(le=MAX_N)] = 1
    best_of: Int64 | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    priority: Int64 = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # What the output must match, from the fields above (or a chat request's forced tool call).
    _structured_outputs: StructuredOutputsParams | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_structured_outputs(self):
        fmt = self.response_format
        constrained = fmt is not None and fmt.type != "text"
        if constrained and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs exclude each other")
        if self.structured_outputs is not None:
            spec = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            self._structured_outputs = _checked_spec("structured_outputs", **spec)
        elif constrained and fmt.type == "json_object":
            self._structured_outputs = _checked_spec("response_format", json_object=True)
        elif constrained:
            schema = fmt.json_schema.schema_ or {"type": "object"}
            self._structured_outputs = _checked_spec("response_format", json=schema)
        return self

    @model_validator(mode="after")
    def _check_unsupported(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self._structured_outputs,
        )


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions``."""

    prompt: PromptInput
    max_tokens: Int64 | None = None  # None: OpenAI's default of 16, capped by the context left
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: Text | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts as a list: texts or token id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return self._sampling_params(max_tokens, self.logprobs)


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


class ChatCompletionRequest(_SamplingFields):
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
        self._structured_outputs = _checked_spec(
            "tools", json=self.tool_call_schema(), disable_any_whitespace=True
        )
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


class UsageInfo(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogProbs(OpenAIResponse):
    """Logprobs of a completion choice, in the legacy completions layout."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


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


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ember"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(OpenAIResponse):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIResponse):
    error: ErrorInfo
