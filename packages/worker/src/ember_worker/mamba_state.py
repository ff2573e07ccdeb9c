"""State of a hybrid's Mamba-2 mixers: one slot per request the batch holds.

The scheduler's state group gives each request one block of the shared pool, whose id leads the
request's block-table row: it names the request's state for as long as the request holds it.
A state is far larger than a KV block (at Bamba-9B's shape a mixer's state is 4 MiB, a block
of its attention layers' KV 0.2 MiB), so the state tensors are not indexed by block id (a row per block of
the pool) but by a compact slot, one per request the batch can hold (``max_num_seqs``):
``MambaStateSlots`` gives a request's state block a free slot when the request joins the batch
and takes it back when it leaves; each step maps the rows' state blocks to their slots with one
indexed read. The SSM state is kept in float32 (it accumulates over the whole request).
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
    def bytes_per_request(self) -> int:
        conv = _numel(self.conv_shape) * torch.empty((), dtype=self.conv_dtype).element_size()
        ssm = _numel(self.ssm_shape) * torch.empty((), dtype=SSM_STATE_DTYPE).element_size()
        return self.num_layers * (conv + ssm)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def allocate_mamba_state(
    spec: MambaStateSpec, num_slots: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(conv window, SSM state) tensors of each mixer, ``num_slots`` slots each."""
    return [
        (
            torch.zeros((num_slots, *spec.conv_shape), dtype=spec.conv_dtype, device=device),
            torch.zeros((num_slots, *spec.ssm_shape), dtype=SSM_STATE_DTYPE, device=device),
        )
        for _ in range(spec.num_layers)
    ]


class MambaStateSlots:
    """Which state slot each held state block uses: ``num_slots`` slots (one per request the
    batch holds), a map from block id to slot over ``num_blocks`` ids."""

    def __init__(self, num_slots: int, num_blocks: int, device: torch.device) -> None:
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of_request: dict[str, tuple[int, int]] = {}  # request -> (block, slot)
        self.slot_of_block = torch.full((num_blocks,), -1, dtype=torch.long)
        self._device_map = None if device.type == "cpu" else self.slot_of_block.to(device)
        self._device = device

    def assign(self, req_id: str, block_id: int) -> None:
        """A request joins the batch holding state block ``block_id``: give it a free slot."""
        if not self._free:
            raise ValueError(f"no free Mamba state slot for request {req_id!r}")
        slot = self._free.pop()
        self._slot_of_request[req_id] = (block_id, slot)
        self._set(block_id, slot)

    def release(self, req_id: str) -> None:
        """A request leaves the batch (finished or preempted): its slot is free again."""
        held = self._slot_of_request.pop(req_id, None)
        if held is not None:
            block_id, slot = held
            self._set(block_id, -1)
            self._free.append(slot)

    def slots(self, state_blocks: torch.Tensor) -> torch.Tensor:
        """The slots of the state blocks ``state_blocks`` (one indexed read)."""
        table = self.slot_of_block if self._device_map is None else self._device_map
        return table[state_blocks.long()]

    def _set(self, block_id: int, slot: int) -> None:
        self.slot_of_block[block_id] = slot
        if self._device_map is not None:
            self._device_map[block_id] = slot


def bind_mamba_state(model: nn.Module, states: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give each mixer of ``model``, in order, its state tensors."""
    mixers = [m for m in model.modules() if isinstance(m, Mamba2Mixer)]
    if len(mixers) != len(states):
        raise ValueError(f"model has {len(mixers)} Mamba mixers, got {len(states)} states")
    for mixer, state in zip(mixers, states):
        mixer.state = state
