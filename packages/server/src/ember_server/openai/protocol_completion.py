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
    prompt_logprobs: Int64 | None = None  # vLLM's: the prompt's logprobs, in ``prompt_logprobs``
    use_beam_search: bool = False  # vLLM's: the n best beams (n is the beam width)
    length_penalty: float = 1.0  # of beam search's score, cum_logprob / length ** penalty

    @model_validator(mode="after")
    def _check_prompt(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.stream and self.echo and self.logprobs is not None:
            raise ValueError("echo together with logprobs is not supported when streaming")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported when streaming")
        if self.use_beam_search:
            unsupported = {
                "stream": self.stream,
                "echo": self.echo,
                "logprobs": self.logprobs is not None,
                "prompt_logprobs": self.prompt_logprobs is not None,
                "stop": bool(self.stop),
                "structured_outputs": self.structured_field is not None,
            }
            named = [name for name, given in unsupported.items() if given]
            if named:
                raise ValueError(f"use_beam_search does not combine with {', '.join(named)}")
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise ValueError("max_tokens 0 needs echo or prompt_logprobs (nothing to return)")
        return self

    @property
    def echoes_logprobs(self) -> bool:
        """Whether the prompt's tokens lead the choices' logprobs (``echo`` with ``logprobs``)."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts as a list: texts or token id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """``max_tokens`` 0 (the prompt's logprobs only) still generates one token, which the
        response leaves out, as vLLM does."""
        if max_tokens == 0:  # (a negative value stays, for SamplingParams to refuse)
            max_tokens = 1
        params = self._sampling_params(max_tokens, self.logprobs)
        if self.prompt_logprobs is None and not self.echoes_logprobs:
            return params
        wanted = [n for n in (self.prompt_logprobs, self.echoes_logprobs and self.logprobs) if n]
        return params.clone(prompt_logprobs=max(wanted, default=self.prompt_logprobs or 0))


class CompletionLogProbs(OpenAIResponse):
    """Logprobs of a completion choice, in the legacy completions layout."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(OpenAIResponse):
    """One entry of vLLM's ``prompt_logprobs``, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: per prompt token (the first is None) the token and the top alternatives.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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
