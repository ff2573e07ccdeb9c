"""Continuous-batching scheduler, requests and engine core of Ember."""

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore, Executor
from ember_scheduler.engine_types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    SpecDecodingStats,
)
from ember_scheduler.outputs import (
    DRAFT_PLACEHOLDER,
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.request import Request, RequestStatus
from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.scheduler import Scheduler
from ember_scheduler.structured_outputs import GrammarCompiler, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "DRAFT_PLACEHOLDER",
    "CachedRequestData",
    "EngineCore",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "Executor",
    "FinishReason",
    "GrammarCompiler",
    "Logprobs",
    "ModelRunnerOutput",
    "NewRequestData",
    "PoolingParams",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SpecDecodingStats",
    "StructuredOutputsParams",
    "__version__",
]
