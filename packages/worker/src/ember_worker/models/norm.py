"""RMSNorm with a learned scale, through ``ember_kernels``, and the pre-norm residual block built on it."""

from __future__ import annotations

from collections.abc import Callable

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


def pre_norm_block(
    hidden_states: torch.Tensor,
    residual: torch.Tensor | None,
    input_norm: RMSNorm,
    mixer: Callable[[torch.Tensor], torch.Tensor],
    post_norm: RMSNorm,
    feed_forward: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pre-norm residual block (attention or any token mixer, then the feed-forward): the
    residual stream rides beside the hidden states so that each norm fuses its addition; the
    first layer's residual is its input."""
    if residual is None:
        residual = hidden_states
        hidden_states = input_norm(hidden_states)
    else:
        hidden_states, residual = input_norm(hidden_states, residual)
    hidden_states, residual = post_norm(mixer(hidden_states), residual)
    return feed_forward(hidden_states), residual
