"""Triton paged attention and fused LLM kernels with torch reference paths.

Every function takes plain tensors and dispatches on their device: CUDA tensors run the Triton
kernels of :mod:`ember_kernels.triton_ops`, CPU tensors the vectorized torch paths of
:mod:`ember_kernels.torch_ops`. Either module can also be called directly.
"""

from ember_kernels.ops import (
    fused_add_rms_norm,
    paged_attention,
    reshape_and_cache,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)
from ember_kernels.rotary_embedding import RotaryEmbedding

__version__ = "0.1.0"

__all__ = [
    "RotaryEmbedding",
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
