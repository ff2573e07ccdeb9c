"""Mamba-2 kernels over a flat batch of variable-length requests with per-request state slots:
the causal convolution, the decode state update and the chunked (SSD) prefill scan.

``ember_kernels.mamba.torch_ops`` is the vectorized torch path (CPU, and the reference);
``ember_kernels.mamba.triton_ops`` holds the Triton decode state update and prefill scan for
GPUs. ``selective_state_update`` and ``ssd_chunk_scan_varlen`` here dispatch on the device.
"""

from __future__ import annotations

import torch

from ember_kernels.mamba import torch_ops
from ember_kernels.mamba.torch_ops import causal_conv1d_varlen


def selective_state_update(ssm_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """One token per request (see ``torch_ops.selective_state_update``): Triton on CUDA
    tensors, torch elsewhere."""
    if ssm_states.is_cuda:
        from ember_kernels.mamba.triton_ops import selective_state_update as triton_update

        return triton_update(ssm_states, *args, **kwargs)
    return torch_ops.selective_state_update(ssm_states, *args, **kwargs)


def ssd_chunk_scan_varlen(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Several tokens per request (see ``torch_ops.ssd_chunk_scan_varlen``): Triton's
    recurrent scan on CUDA tensors, the chunked torch scan elsewhere."""
    if x.is_cuda:
        from ember_kernels.mamba.triton_ops import varlen_scan

        return varlen_scan(x, *args, **kwargs)
    return torch_ops.ssd_chunk_scan_varlen(x, *args, **kwargs)


__all__ = ["causal_conv1d_varlen", "selective_state_update", "ssd_chunk_scan_varlen"]
