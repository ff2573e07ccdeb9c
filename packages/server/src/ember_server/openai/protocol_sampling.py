"""The sampling fields completions and chat completions share (OpenAI's and vLLM's), and what
the output must match (``response_format``, vLLM's ``structured_outputs``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, model_validator

from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_server.openai.protocol import Int64, JSONObject, OpenAIRequest, Text

MAX_N = 128  # OpenAI's limit on choices per request


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


def structured_spec(field: str, **spec) -> StructuredOutputsParams:
    """The spec from request ``field``; a ValueError starting with ``field`` when it is not one
    (exactly one kind, of the right type). Whether it parses as a grammar is the input
    processor's check, when the request is made; the route names ``field`` in that error too."""
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


class SamplingFields(OpenAIRequest):
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
    # Seconds the request may take before it is aborted (default: ember serve --request-timeout).
    timeout: Annotated[float, Field(gt=0)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs' tokens as "token_id:<id>"
    # What the output must match, from the fields above (or a chat request's forced tool call).
    _structured_outputs: StructuredOutputsParams | None = PrivateAttr(default=None)
    # The request field it came from: response_format, structured_outputs or tools.
    _structured_field: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _check_structured_outputs(self):
        fmt = self.response_format
        constrained = fmt is not None and fmt.type != "text"
        if constrained and self.structured_outputs is not None:
            raise ValueError("response_format and structured_outputs exclude each other")
        if self.structured_outputs is not None:
            spec = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            self.constrain("structured_outputs", **spec)
        elif constrained and fmt.type == "json_object":
            self.constrain("response_format", json_object=True)
        elif constrained:
            schema = fmt.json_schema.schema_ or {"type": "object"}
            self.constrain("response_format", json=schema)
        return self

    def constrain(self, field: str, **spec) -> None:
        """Make the output match ``spec``, which request ``field`` asked for."""
        self._structured_outputs = structured_spec(field, **spec)
        self._structured_field = field

    @property
    def structured_field(self) -> str | None:
        """The request field the output's structure came from, if any."""
        return self._structured_field

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
