"""Quantization applied to a model's weights after loading (``quantization``), one owner of the
names and their check.

``int8_weight_only``: every projection's weight and the LM head's (a tied head as a quantized
copy: the embedding lookup keeps the float table) become int8 with one float32 scale per output
channel; activations, norms, the embedding and the KV cache keep the model's dtype. The name is
torchao's for this scheme (vLLM has no name for weight-only int8 of dense layers; it reaches
torchao's through ``quantization="torchao"``). Under tensor parallelism each rank quantizes its own
shards, so the scales are those of the full weight's rows that the rank holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the API server checks the name without importing torch
    from ember_worker.models import DecoderForCausalLM

QUANTIZATION_METHODS = ("int8_weight_only",)


def check_quantization(quantization: str | None, owner: str = "quantization") -> str | None:
    """``quantization`` if it is None or one of ``QUANTIZATION_METHODS``; else ValueError naming
    ``owner`` (the field, as the caller spells it)."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"{owner} must be None or one of {QUANTIZATION_METHODS}, got {quantization!r}"
        )
    return quantization


def quantize_model(model: DecoderForCausalLM, quantization: str | None) -> None:
    """Apply ``quantization`` to a loaded model's weights in place (None: nothing)."""
    if check_quantization(quantization) is None:
        return
    model.quantize_linear_weights()
