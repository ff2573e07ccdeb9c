"""Model loading, models, input batch, sampler and model runner of Ember.

The public names are imported on first use, so that ``ember_worker.tiny_models`` (used by every
package's tests) does not pull in torch and the kernels.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "InProcessExecutor": "ember_worker.executor",
    "ModelRunner": "ember_worker.model_runner",
    "LoadedModel": "ember_worker.model_loader",
    "load_model": "ember_worker.model_loader",
    "resolve_model_path": "ember_worker.model_loader",
    "DecoderConfig": "ember_worker.models",
    "DecoderForCausalLM": "ember_worker.models",
    "SUPPORTED_ARCHITECTURES": "ember_worker.models",
    "InputBatch": "ember_worker.input_batch",
    "Sampler": "ember_worker.sampler",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ember_worker' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
