"""Triton kernels: the path for CUDA tensors (CPU tensors run them under ``TRITON_INTERPRET=1``)."""

from ember_kernels.triton_ops import lora, lora_segment
from ember_kernels.triton_ops.activation import silu_and_mul
from ember_kernels.triton_ops.cache import reshape_and_cache
from ember_kernels.triton_ops.fused_moe import fused_experts
from ember_kernels.triton_ops.layernorm import fused_add_rms_norm, rms_norm
from ember_kernels.triton_ops.paged_attention import paged_attention
from ember_kernels.triton_ops.rotary import rotary_embedding

__all__ = [
    "fused_add_rms_norm",
    "fused_experts",
    "lora",
    "lora_segment",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
