"""The LoRA delta of one tensor-parallel linear layer: its adapter slots and the segmented
shrink/expand (``ember_kernels.lora``) that adds each row's adapter to the layer's output.

A layer of ``n`` slices (q/k/v, gate/up, or one) holds ``a [slots, n * max_rank, in]`` (the
slices' ``A`` side by side, so one shrink serves all of them) and per slice ``b [slots, out,
max_rank]`` (a transposed view), zero where a slot holds no adapter or a smaller rank. Under
tensor parallelism the slots hold this rank's shard, cut as the layer cuts its weight: a
column-parallel layer's ``B`` rows, a row-parallel layer's ``A`` columns (whose partial shrink
is summed over the group). The compiled CPU decoder stack holds the same tensors
(``models.cpu_stack``), so a slot written here is what both paths read.
"""

from __future__ import annotations

import torch

from ember_kernels.lora import LoRAMapping, lora_expand, lora_shrink
from ember_worker.layers.linear import QKVParallelLinear, RowParallelLinear


class LoRAStepMapping:
    """The mapping of the step being run, shared by every layer's delta (None: no row of the
    step has an adapter, and the layers skip the delta)."""

    mapping: LoRAMapping | None = None


class LoRALinearDelta:
    """Adapter slots of one linear layer; ``layer(x)`` calls ``delta(x, y)`` on its output."""

    def __init__(
        self,
        layer: torch.nn.Module,
        slice_sizes: tuple[int, ...],
        num_slots: int,
        max_rank: int,
        step: LoRAStepMapping,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.layer = layer
        self.step = step
        self.max_rank = max_rank
        self.row_parallel = isinstance(layer, RowParallelLinear)
        tp = layer.tp
        self.tp = tp
        if self.row_parallel:
            in_local = layer.input_size_per_partition
            self.out_sizes = slice_sizes
        else:
            in_local = layer.input_size
            self.out_sizes = tuple(layer.shard_sizes)
        self.a = torch.zeros(
            num_slots, len(slice_sizes) * max_rank, in_local, dtype=dtype, device=device
        )
        # Each B as the transpose of a [slots, max_rank, out] tensor: the compiled expand then
        # adds rank-long runs of whole output rows (``ember_kernels.cpu_ops.lora_expand``).
        self.b = [
            torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device).transpose(1, 2)
            for size in self.out_sizes
        ]

    def set_slot(
        self, slot: int, slices: dict[int, tuple[torch.Tensor, torch.Tensor]] | None
    ) -> None:
        """Write an adapter's full ``(A, B)`` per slice into ``slot`` (this rank's shard);
        slices it lacks, and ``None``, leave zeros."""
        r_max = self.max_rank
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()
        for index, (a, b) in (slices or {}).items():
            r = a.shape[0]
            self.a[slot, index * r_max : index * r_max + r].copy_(self._shard_a(a))
            self.b[index][slot, :, :r].copy_(self._shard_b(b, index))

    def _shard_a(self, a: torch.Tensor) -> torch.Tensor:
        if not self.row_parallel:
            return a
        size = self.layer.input_size_per_partition
        return a.narrow(1, self.tp.rank * size, size)

    def _shard_b(self, b: torch.Tensor, index: int) -> torch.Tensor:
        if self.row_parallel:
            return b
        size = self.out_sizes[index]
        rank = self.tp.rank
        if isinstance(self.layer, QKVParallelLinear) and index > 0:
            rank //= self.layer.kv_replicas  # key/value heads replicated over the group
        return b.narrow(0, rank * size, size)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus each row's adapter delta, in place; ``y`` alone when no row has one."""
        mapping = self.step.mapping
        if mapping is None:
            return y
        x = x.reshape(-1, x.shape[-1])
        h = lora_shrink(x, self.a, mapping)
        if self.row_parallel:
            h = self.tp.all_reduce(h)
        offset = 0
        for index, b in enumerate(self.b):
            lora_expand(y, h, b, mapping, y_offset=offset, h_offset=index * self.max_rank)
            offset += b.shape[1]
        return y
