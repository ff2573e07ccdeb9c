"""RMSNorm with a learned scale, through ``ember_kernels``."""

from __future__ import annotations

import torch
from torch import nn

import ember_kernels as ek


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, through ``ember_kernels``."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: the norm of ``x``. With it: (norm of x + residual, x + residual)."""
        if residual is None:
            return ek.rms_norm(x, self.weight, self.eps)
        return ek.fused_add_rms_norm(x, residual, self.weight, self.eps)
