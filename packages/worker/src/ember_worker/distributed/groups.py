"""Ranks and ``torch.distributed`` groups of one worker: tensor parallel inside pipeline stages.

Global rank ``pp_rank * tp_size + tp_rank``: the ranks of one pipeline stage are consecutive (on
one machine when a stage fits one), and the ranks with the same ``tp_rank`` form the pipeline
group that hands activations from stage to stage. Another dimension (experts) is one more group
built here from the same world.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from ember_scheduler.config import check_int
from ember_worker.expert_placement import check_expert_placement
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup


class ParallelConfig(msgspec.Struct, frozen=True):
    """How many tensor-parallel ranks per stage, how many pipeline stages, and whether MoE
    layers split their experts over the tensor-parallel ranks (expert parallelism)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Mixture-of-experts layers: whole experts per tensor-parallel rank (``models.moe``).
    enable_expert_parallel: bool = False
    # Which rank holds which experts: "linear" (contiguous blocks) or "round_robin" (vLLM's).
    expert_placement_strategy: str = "linear"

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            check_int(name, getattr(self, name))
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}"
            )
        check_expert_placement(self.expert_placement_strategy)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def output_rank(self) -> int:
        """The rank that returns sampled tokens: the last stage's first tensor-parallel rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size


@dataclass
class PipelineStage:
    """This rank's pipeline stage: which layers it holds and how it reaches its neighbours."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    prev_rank: int | None = None  # global ranks of the neighbours in this pipeline group
    next_rank: int | None = None
    last_rank: int | None = None

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers this stage holds (as even a split as possible)."""
        if num_layers < self.size:
            raise ValueError(
                f"pipeline_parallel_size ({self.size}) exceeds the model's "
                f"num_hidden_layers ({num_layers})"
            )
        return num_layers * self.rank // self.size, num_layers * (self.rank + 1) // self.size

    def send(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Hand this stage's activations to the next stage."""
        for tensor in tensors:
            dist.send(tensor.contiguous(), self.next_rank, group=self.group)

    def recv(self, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Receive the previous stage's activations into tensors shaped as ``like``."""
        for tensor in like:
            dist.recv(tensor, self.prev_rank, group=self.group)
        return like

    def share_from_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Broadcast ``tensor`` from the last stage to every stage (in place)."""
        if self.size > 1:
            dist.broadcast(tensor, self.last_rank, group=self.group)
        return tensor


SINGLE_STAGE = PipelineStage()


@dataclass
class RankGroups:
    """The groups one rank belongs to."""

    rank: int
    tp: TensorParallelGroup
    pp: PipelineStage


def single_rank_groups() -> RankGroups:
    return RankGroups(0, SINGLE_RANK, SINGLE_STAGE)


def init_rank_groups(
    config: ParallelConfig, rank: int, init_method: str, backend: str, timeout_s: float = 600.0
) -> RankGroups:
    """Join the world at ``init_method`` (``tcp://host:port``) and build this rank's groups.

    Every rank builds every group in the same order, as ``new_group`` requires.
    """
    world, tp_size, pp_size = (
        config.world_size,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
    )
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=world,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = pp_group = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks, backend=backend) if tp_size > 1 else None
        if stage == pp_rank:
            tp_group = group
    for column in range(tp_size):
        ranks = list(range(column, world, tp_size))
        group = dist.new_group(ranks, backend=backend) if pp_size > 1 else None
        if column == tp_rank:
            pp_group = group
    stage_rank = lambda s: s * tp_size + tp_rank  # noqa: E731
    pp = PipelineStage(
        rank=pp_rank,
        size=pp_size,
        group=pp_group,
        prev_rank=stage_rank(pp_rank - 1) if pp_rank > 0 else None,
        next_rank=stage_rank(pp_rank + 1) if pp_rank < pp_size - 1 else None,
        last_rank=stage_rank(pp_size - 1),
    )
    return RankGroups(rank, TensorParallelGroup(tp_rank, tp_size, tp_group), pp)


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now, for the rendezvous (rank 0 binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
