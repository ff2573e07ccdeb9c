"""Model loading, models, input batch, sampler and model runner of Ember."""

from ember_worker.executor import InProcessExecutor
from ember_worker.input_batch import InputBatch
from ember_worker.model_loader import LoadedModel, load_model, resolve_model_path
from ember_worker.model_runner import ModelRunner
from ember_worker.models import SUPPORTED_ARCHITECTURES, DecoderConfig, DecoderForCausalLM
from ember_worker.sampler import Sampler

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "DecoderConfig",
    "DecoderForCausalLM",
    "InProcessExecutor",
    "InputBatch",
    "LoadedModel",
    "ModelRunner",
    "Sampler",
    "__version__",
    "load_model",
    "resolve_model_path",
]
