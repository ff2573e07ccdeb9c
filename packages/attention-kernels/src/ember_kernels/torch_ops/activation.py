"""SiLU-and-mul (the gated MLP activation) in torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2*d]``, computed in the input dtype."""
    d = x.shape[-1] // 2
    result = F.silu(x[..., :d]) * x[..., d:]
    if out is None:
        return result
    out.copy_(result)
    return out
