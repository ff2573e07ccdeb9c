"""The dense SwiGLU feed-forward block of the decoder (also the shared expert of MoE layers)."""

from __future__ import annotations

import torch
from torch import nn

import ember_kernels as ek
from ember_worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from ember_worker.layers.parallel import TensorParallelGroup
from ember_worker.models.config import DecoderConfig


class DecoderMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` with gate and up in one matmul;
    ``intermediate_size`` defaults to the config's."""

    def __init__(
        self,
        config: DecoderConfig,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        intermediate_size: int | None = None,
    ) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [size, size], bias=config.mlp_bias, tp=tp, dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            size, config.hidden_size, bias=config.mlp_bias, tp=tp, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ek.silu_and_mul(self.gate_up_proj(x)))
