"""The tensor-parallel group a layer is sharded over."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank and size of the tensor-parallel group; layers shard their weights by these.

    Only a group of size 1 is implemented: its collectives are the identity. Larger groups raise
    at construction, so a model is never built half-sharded.
    """

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size != 1:
            raise NotImplementedError(
                f"tensor_parallel_size={self.size} is not implemented; Ember runs one worker "
                "(tensor_parallel_size=1)"
            )
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x


SINGLE_RANK = TensorParallelGroup()


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})"
        )
    return numerator // denominator
