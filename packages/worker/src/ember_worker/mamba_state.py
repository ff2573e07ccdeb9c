"""State tensors of a hybrid's Mamba-2 mixers, indexed by the KV cache's block ids.

The scheduler's state group gives each request one block of the shared pool; its id is the
request's slot in every mixer's conv-window and SSM-state tensors. Each tensor has a row per
block of the pool (a block id of any group is a valid slot), so a block costs its KV bytes plus
one state's bytes; the SSM state is kept in float32 (it accumulates over the whole request).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ember_worker.models.mamba_mixer import Mamba2Mixer

SSM_STATE_DTYPE = torch.float32


@dataclass(frozen=True)
class MambaStateSpec:
    """Shapes of one request's state in each of ``num_layers`` mixers."""

    num_layers: int
    conv_shape: tuple[int, int]  # (channels, width - 1)
    ssm_shape: tuple[int, int, int]  # (heads, head_dim, state)
    conv_dtype: torch.dtype

    @classmethod
    def for_model(cls, model: nn.Module) -> MambaStateSpec | None:
        """The spec of ``model``'s mixers; None for a model without any."""
        mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
        if not mixers:
            return None
        first = mixers[0]
        return cls(
            num_layers=len(mixers),
            conv_shape=(first.conv_channels, first.conv1d.weight.shape[-1] - 1),
            ssm_shape=(first.num_heads, first.head_dim, first.state_size),
            conv_dtype=first.conv1d.weight.dtype,
        )

    @property
    def bytes_per_block(self) -> int:
        conv = _numel(self.conv_shape) * torch.empty((), dtype=self.conv_dtype).element_size()
        ssm = _numel(self.ssm_shape) * torch.empty((), dtype=SSM_STATE_DTYPE).element_size()
        return self.num_layers * (conv + ssm)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def allocate_mamba_state(
    spec: MambaStateSpec, num_blocks: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv window, SSM state) tensors of each mixer, ``num_blocks`` slots each."""
    return [
        (
            torch.zeros((num_blocks, *spec.conv_shape), dtype=spec.conv_dtype, device=device),
            torch.zeros((num_blocks, *spec.ssm_shape), dtype=SSM_STATE_DTYPE, device=device),
        )
        for _ in range(spec.num_layers)
    ]


def bind_mamba_state(model: nn.Module, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each mixer of ``model``, in order, its state tensors."""
    mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
    if len(mixers) != len(states):
        raise ValueError(f"model has {len(mixers)} Mamba mixers, got {len(states)} states")
    for mixer, state in zip(mixers, states):
        mixer.state = state
