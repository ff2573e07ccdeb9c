"""Model loading, models, input batch, sampler and model runner of Ember.

The names below are imported on first use, so that a process that only reads a model's config
(the API server, through ``ember_worker.hf_config``) never imports torch.
"""

import importlib

__version__ = "0.1.0"

_MODULE_OF = {
    "SUPPORTED_ARCHITECTURES": "ember_worker.models",
    "DecoderConfig": "ember_worker.models",
    "DecoderForCausalLM": "ember_worker.models",
    "InProcessExecutor": "ember_worker.executor",
    "InputBatch": "ember_worker.input_batch",
    "LoadedModel": "ember_worker.model_loader",
    "ModelRunner": "ember_worker.model_runner",
    "Sampler": "ember_worker.sampler",
    "Worker": "ember_worker.distributed.worker",
    "WorkerConfig": "ember_worker.distributed.worker",
    "load_model": "ember_worker.model_loader",
    "resolve_model_path": "ember_worker.hf_config",
}

__all__ = [*sorted(_MODULE_OF), "__version__"]


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'ember_worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
