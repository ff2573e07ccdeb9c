"""Offline LLM API, OpenAI-compatible HTTP server, metrics and CLI of Ember.

``engine/`` is the engine client side (``LLM``, ``AsyncLLM``, processors, the engine core
process and its client); ``openai/`` the HTTP routes; ``cli/`` the ``ember`` command. The names
below load on first use, so that ``import ember_server`` (the API server's start-up) costs
nothing and brings no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "ember_server.engine.llm",
    "AsyncLLM": "ember_server.engine.async_llm",
    "BeamSearchParams": "ember_server.engine.beam_search",
    "EngineArgs": "ember_server.engine.engine_args",
    "RequestOutput": "ember_server.engine.outputs",
    "CompletionOutput": "ember_server.engine.outputs",
    "PoolingRequestOutput": "ember_server.engine.pooling_outputs",
    "EmbeddingRequestOutput": "ember_server.engine.pooling_outputs",
    "ClassificationRequestOutput": "ember_server.engine.pooling_outputs",
    "ScoringRequestOutput": "ember_server.engine.pooling_outputs",
    "SamplingParams": "ember_scheduler.sampling_params",
    "PoolingParams": "ember_scheduler.pooling_params",
    "StructuredOutputsParams": "ember_scheduler.structured_outputs",
    "LoRARequest": "ember_scheduler.lora",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchParams",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LoRARequest",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from ember_scheduler.lora import LoRARequest
    from ember_scheduler.pooling_params import PoolingParams
    from ember_scheduler.sampling_params import SamplingParams
    from ember_scheduler.structured_outputs import StructuredOutputsParams
    from ember_server.engine.async_llm import AsyncLLM
    from ember_server.engine.beam_search import BeamSearchParams
    from ember_server.engine.engine_args import EngineArgs
    from ember_server.engine.llm import LLM
    from ember_server.engine.outputs import CompletionOutput, RequestOutput
    from ember_server.engine.pooling_outputs import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember_server' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
