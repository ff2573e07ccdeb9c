"""Quantization applied to a model's weights after loading (``quantization``), one owner of the
names and their check.

``int8_weight_only``: the projections' weights and the LM head's (a tied head as a quantized
copy: the embedding lookup keeps the float table) become int8 with a float32 scale per group of
128 inputs of each output channel (64 or one per channel where 128 does not divide the inputs:
``ember_kernels.int8_linear.weight_group_size``); activations, norms, the embedding and the KV
cache keep the model's dtype, and so do the projections of ``FLOAT_PROJECTIONS``. The name is
torchao's for this scheme (vLLM has no name for weight-only int8 of dense layers; it reaches
torchao's through ``quantization="torchao"``). Under tensor parallelism each rank quantizes its
own shards, with the group size of its own input slice.

``compressed-tensors`` (vLLM's name): a checkpoint already quantized, W8A8 int8
(``ember_worker.compressed_tensors``); found from its config.json whether named or not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the API server checks the name without importing torch
    from ember_worker.models import DecoderForCausalLM

# vLLM's name, and the ``quant_method`` such a checkpoint's config.json names.
COMPRESSED_TENSORS = "compressed-tensors"
QUANTIZATION_METHODS = ("int8_weight_only", COMPRESSED_TENSORS)
# Quantizations applied to a float checkpoint's weights after loading.
POST_LOAD_METHODS = ("int8_weight_only",)
# Projections int8_weight_only leaves in the model's dtype: the fused query/key/value projection,
# whose rounding errors move every attention score. Measured by teacher forcing (the worker
# README), quantizing it alone cost about as many argmax agreements as the other projections and
# the head together; it holds about 5% of a Qwen2.5-0.5B's weights.
FLOAT_PROJECTIONS = ("qkv_proj",)


def check_quantization(quantization: str | None, owner: str = "quantization") -> str | None:
    """``quantization`` if it is None or one of ``QUANTIZATION_METHODS``; else ValueError naming
    ``owner`` (the field, as the caller spells it)."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"{owner} must be None or one of {QUANTIZATION_METHODS}, got {quantization!r}"
        )
    return quantization


def resolve_quantization(quantization: str | None, checkpoint: str | None) -> str | None:
    """The quantization to run: ``checkpoint``'s own (``compressed_tensors.
    checkpoint_quantization``), which ``quantization`` may name or leave None, else
    ``quantization``; ValueError naming the field where they conflict."""
    check_quantization(quantization)
    if checkpoint is not None and quantization not in (None, checkpoint):
        raise ValueError(
            f"quantization: the checkpoint is already quantized ({checkpoint}); "
            f"got {quantization!r}, expected None or {checkpoint!r}"
        )
    if checkpoint is None and quantization == COMPRESSED_TENSORS:
        raise ValueError(
            f"quantization: {COMPRESSED_TENSORS!r} needs a checkpoint whose config.json has a "
            f"{COMPRESSED_TENSORS} quantization_config"
        )
    return checkpoint or quantization


def quantize_model(model: DecoderForCausalLM, quantization: str | None) -> None:
    """Apply ``quantization`` to a loaded model's weights in place (None, or a checkpoint's own:
    nothing)."""
    if check_quantization(quantization) not in POST_LOAD_METHODS:
        return
    model.quantize_linear_weights(keep_float=FLOAT_PROJECTIONS)
