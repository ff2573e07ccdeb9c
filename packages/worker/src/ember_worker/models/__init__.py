"""The supported decoder-only architectures: one decoder, configured per architecture."""

from ember_worker.models.config import SUPPORTED_ARCHITECTURES, DecoderConfig
from ember_worker.models.decoder import DecoderForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderConfig", "DecoderForCausalLM"]
