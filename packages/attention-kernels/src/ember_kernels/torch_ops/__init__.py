"""Vectorized torch implementations: the path for CPU tensors (they run on any device)."""

from ember_kernels.torch_ops import lora
from ember_kernels.torch_ops.activation import silu_and_mul
from ember_kernels.torch_ops.cache import reshape_and_cache
from ember_kernels.torch_ops.layernorm import fused_add_rms_norm, rms_norm
from ember_kernels.torch_ops.paged_attention import paged_attention
from ember_kernels.torch_ops.rotary import rotary_embedding

__all__ = [
    "fused_add_rms_norm",
    "lora",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
