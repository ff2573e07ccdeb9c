"""Which rank of an expert-parallel group holds which routed expert.

Two balanced placements, as vLLM's ``expert_placement_strategy`` names them: ``"linear"`` gives
each rank a contiguous block of experts, ``"round_robin"`` deals expert ``e`` to rank
``e % size``. Either way the ranks' shares differ by at most one expert, so the experts need not
divide evenly over the ranks. A rank keeps its experts' weights stacked in ascending global id
order; an expert's local index is its position in that stack.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PLACEMENT_STRATEGIES = ("linear", "round_robin")


@dataclass(frozen=True)
class ExpertPlacement:
    """``num_experts`` routed experts over an expert-parallel group of ``size`` ranks."""

    num_experts: int
    size: int
    strategy: str = "linear"

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"size: must be a positive int, got {self.size!r}")
        if not isinstance(self.num_experts, int) or self.num_experts < self.size:
            raise ValueError(
                f"num_experts: {self.num_experts!r} experts cannot give each of {self.size} "
                "expert-parallel ranks one"
            )
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"strategy: must be one of {PLACEMENT_STRATEGIES}, got {self.strategy!r}"
            )

    def local_experts(self, rank: int) -> list[int]:
        """The global ids of the experts ``rank`` holds, ascending."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank: must be in [0, {self.size}), got {rank!r}")
        if self.strategy == "round_robin":
            return list(range(rank, self.num_experts, self.size))
        start = self.num_experts * rank // self.size
        return list(range(start, self.num_experts * (rank + 1) // self.size))

    def owners(self) -> torch.Tensor:
        """``[num_experts]`` int64: the rank holding each expert."""
        ids = torch.arange(self.num_experts)
        if self.strategy == "round_robin":
            return ids % self.size
        # Rank r's block starts at floor(E * r / P): expert e belongs to the last such start <= e.
        starts = torch.tensor([self.num_experts * r // self.size for r in range(self.size)])
        return torch.searchsorted(starts, ids, right=True) - 1

    def local_indices(self) -> torch.Tensor:
        """``[num_experts]`` int64: each expert's index in its owner's stack."""
        owners = self.owners()
        first = torch.zeros(self.size, dtype=torch.long)
        counts = torch.bincount(owners, minlength=self.size)
        first[1:] = counts.cumsum(0)[:-1]
        if self.strategy == "round_robin":
            return torch.arange(self.num_experts) // self.size
        return torch.arange(self.num_experts) - first[owners]

    def expert_map(self, rank: int) -> torch.Tensor:
        """``[num_experts]`` int64: the local index on ``rank`` of each expert it holds, -1 for
        the others (the ``expert_map`` of ``ember_kernels.moe.fused_experts``)."""
        held = torch.tensor(self.local_experts(rank), dtype=torch.long)
        out = torch.full((self.num_experts,), -1, dtype=torch.long)
        out[held] = torch.arange(len(held))
        return out
