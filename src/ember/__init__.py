"""Ember: an LLM inference and serving engine. This meta-package re-exports the public API."""

from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.llm import LLM
from ember_server.engine.outputs import CompletionOutput, RequestOutput
from ember_server.engine.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]
