"""The tensor-parallel group a layer is sharded over."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TensorParallelGroup:
    """Rank and size of the tensor-parallel group; layers shard their weights by these.

    A group of size 1 needs no process group and its collectives are the identity. A larger group
    wraps a ``torch.distributed`` process group (gloo on the CPU, nccl on GPUs) built by
    ``ember_worker.distributed.groups``.
    """

    def __init__(
        self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None
    ) -> None:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        if size > 1 and group is None:
            raise ValueError(
                f"a tensor-parallel group of size {size} needs a torch.distributed process group"
            )
        self.rank = rank
        self.size = size
        self.group = group

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, size={self.size})"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE_RANK = TensorParallelGroup()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator
