"""Request and response models of the OpenAI API, with its field names and vLLM's extra fields:
what every route shares. Each route's own models live beside it (``protocol_sampling``: the
sampling fields of completions and chat; ``protocol_completion``, ``protocol_chat``,
``protocol_tokenize``, ``protocol_pooling``).

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

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ember_scheduler.sampling_params import INT64_MAX, INT64_MIN

# Integers travel to the engine core as msgpack int64: larger ones are a 400, not a crash.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
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
# builds an error per id, an order of magnitude slower per request.
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


class PromptTokensDetails(OpenAIResponse):
    """How the prompt was served: ``cached_tokens`` came from the prefix cache (or a KV
    connector's hits) instead of being computed."""

    cached_tokens: int = 0


class UsageInfo(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> UsageInfo:
        """Usage of a request; generation routes pass ``cached_tokens`` (pooling ones do not)."""
        details = (
            None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        )
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ember"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
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
