"""Request and response models of ``POST /v1/completions``."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, model_validator

from ember_scheduler.sampling_params import SamplingParams
from ember_server.openai.protocol import Int64, OpenAIResponse, PromptInput, Text, UsageInfo
from ember_server.openai.protocol_sampling import SamplingFields


class CompletionRequest(SamplingFields):
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
