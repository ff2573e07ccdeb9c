"""What pooling requests return (``LLM.encode/embed/classify/score``), in vLLM's shapes."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class PoolingOutput:
    """A pooling request's raw result: ``data`` is a float32 numpy vector."""

    data: np.ndarray


@dataclasses.dataclass
class PoolingRequestOutput:
    """One pooling request's result; always ``finished`` (a pooling request has no partial
    outputs). ``num_cached_tokens``: prompt tokens served from the prefix cache."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        embedding = EmbeddingOutput(output.outputs.data.tolist())
        return cls(output.request_id, embedding, output.prompt_token_ids, output.finished)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # one per label (softmax; sigmoid of the one logit for a single label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> ClassificationRequestOutput:
        probs = ClassificationOutput(output.outputs.data.tolist())
        return cls(output.request_id, probs, output.prompt_token_ids, output.finished)


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
