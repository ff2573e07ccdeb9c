"""Request and response models of the pooling routes: OpenAI's ``/v1/embeddings``, and vLLM's
``/classify``, ``/score`` and ``/rerank`` (the Jina rerank shape)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, model_validator

from ember_scheduler.sampling_params import INT32_MAX
from ember_server.openai.protocol import (
    Int64,
    OpenAIRequest,
    OpenAIResponse,
    PromptInput,
    Text,
    UsageInfo,
)


class _PoolingFields(OpenAIRequest):
    model: Text | None = None
    user: Text | None = None
    priority: Int64 = 0
    add_special_tokens: bool = True


def inputs_of(value: PromptInput) -> list[str | list[int]]:
    """The separate prompts of an ``input`` field (one string or token list is one prompt)."""
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


class EmbeddingRequest(_PoolingFields):
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=INT32_MAX)
    normalize: bool = True  # vLLM's extra field

    @model_validator(mode="after")
    def _check_input(self) -> EmbeddingRequest:
        _check_inputs(self.input)
        return self


class ClassificationRequest(_PoolingFields):
    input: PromptInput

    @model_validator(mode="after")
    def _check_input(self) -> ClassificationRequest:
        _check_inputs(self.input)
        return self


class ScoreRequest(_PoolingFields):
    text_1: Text | list[Text]
    text_2: Text | list[Text]


class RerankRequest(_PoolingFields):
    query: Text
    documents: list[Text]
    top_n: int = Field(default=0, ge=0, le=INT32_MAX)  # 0: every document
    return_documents: bool = True


def _check_inputs(value: PromptInput) -> None:
    prompts = inputs_of(value)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("input must not be empty, nor hold an empty string or token list")


class EmbeddingData(OpenAIResponse):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format=base64


class _ListResponse(OpenAIResponse):
    """The envelope of embeddings, classifications and scores: a list of ``data``, and usage."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponse(_ListResponse):
    data: list[EmbeddingData]


class ClassificationData(OpenAIResponse):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse):
    data: list[ClassificationData]


class ScoreData(OpenAIResponse):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_ListResponse):
    data: list[ScoreData]


class RerankDocument(OpenAIResponse):
    text: str


class RerankResult(OpenAIResponse):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(OpenAIResponse):
    total_tokens: int


class RerankResponse(OpenAIResponse):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
