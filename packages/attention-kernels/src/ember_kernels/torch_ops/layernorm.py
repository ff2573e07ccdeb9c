"""RMSNorm and fused residual-add RMSNorm in torch (float32 statistics, as Hugging Face Llama)."""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dim, statistics in float32."""
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    result = weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``; the sum is rounded to the input dtype first."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
