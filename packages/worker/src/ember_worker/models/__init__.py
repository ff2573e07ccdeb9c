"""The supported decoder-only architectures: one decoder, configured per architecture (dense,
mixture-of-experts and latent-attention layers alike)."""

from ember_worker.models.config import SEQUENCE_CLASSIFIERS, SUPPORTED_ARCHITECTURES, DecoderConfig
from ember_worker.models.decoder import DecoderForCausalLM, DecoderForSequenceClassification

__all__ = [
    "SEQUENCE_CLASSIFIERS",
    "SUPPORTED_ARCHITECTURES",
    "DecoderConfig",
    "DecoderForCausalLM",
    "DecoderForSequenceClassification",
]
