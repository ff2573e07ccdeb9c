"""Ranks and ``torch.distributed`` groups of one worker: tensor parallel inside pipeline stages.

Global rank ``pp_rank * tp_size + tp_rank``: the ranks of one pipeline stage are consecutive (on
one machine when a stage fits one), and the ranks with the same ``tp_rank`` form the pipeline
group that hands activations from stage to stage. Another dimension (experts) is one more group
built here from the same world.

Data-parallel attention with expert parallelism (``ParallelConfig.data_parallel_size`` > 1): the
ranks of every data-parallel replica (each an engine core with its own executor) join one world of
``data_parallel_size * world_size`` ranks, replica ``d``'s rank ``r`` as ``d * world_size + r``.
Attention's tensor-parallel groups stay inside a replica; the expert-parallel group is the whole
world.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import msgspec
import torch
import torch.distributed as dist

from ember_scheduler.config import check_int
from ember_worker.distributed.ports import free_port  # noqa: F401  (its public home was here)
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
    # Data-parallel attention with expert parallelism: this executor is replica
    # ``data_parallel_rank`` of ``data_parallel_size``, whose ranks all meet at
    # ``data_parallel_init_method`` (tcp://host:port) to form one expert-parallel group. Left at
    # 1, replicas (if any) are independent engines and this executor's world is its own.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_init_method: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            check_int(name, getattr(self, name))
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(
                f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}"
            )
        check_expert_placement(self.expert_placement_strategy)
        if self.data_parallel_size > 1:
            if not self.enable_expert_parallel:
                raise ValueError(
                    "data_parallel_size: replicas share a world only for expert parallelism "
                    "(enable_expert_parallel)"
                )
            if self.pipeline_parallel_size > 1:
                raise ValueError(
                    "pipeline_parallel_size: data-parallel attention with expert parallelism "
                    "runs one pipeline stage"
                )
            if not self.data_parallel_init_method:
                raise ValueError(
                    "data_parallel_init_method: the replicas' ranks need a rendezvous address"
                )
        if not (
            isinstance(self.data_parallel_rank, int)
            and 0 <= self.data_parallel_rank < self.data_parallel_size
        ):
            raise ValueError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                f"got {self.data_parallel_rank!r}"
            )

    @property
    def world_size(self) -> int:
        """This executor's ranks (one data-parallel replica's)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def spans_data_parallel(self) -> bool:
        """Whether the expert-parallel group reaches over data-parallel replicas: then every
        replica must run a forward whenever any does (``models.moe.idle_expert_pass``)."""
        return self.data_parallel_size > 1

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
    # The expert-parallel group where it is wider than ``tp`` (over data-parallel replicas).
    ep: TensorParallelGroup | None = None


def single_rank_groups() -> RankGroups:
    return RankGroups(0, SINGLE_RANK, SINGLE_STAGE)


def init_rank_groups(
    config: ParallelConfig, rank: int, init_method: str, backend: str, timeout_s: float = 600.0
) -> RankGroups:
    """Join the world at ``init_method`` (``tcp://host:port``) and build this rank's groups.

    ``rank`` is this executor's (``[0, world_size)``); with ``config.spans_data_parallel`` the
    world is every replica's ranks, met at ``config.data_parallel_init_method``.
    Every rank builds every group in the same order, as ``new_group`` requires.
    """
    world, tp_size, pp_size = (
        config.world_size,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
    )
    replicas, replica = config.data_parallel_size, config.data_parallel_rank
    dist.init_process_group(
        backend,
        init_method=config.data_parallel_init_method if replicas > 1 else init_method,
        world_size=replicas * world,
        rank=replica * world + rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = pp_group = None
    for other in range(replicas):  # one pipeline stage each when there are several
        for stage in range(pp_size):
            first = other * world + stage * tp_size
            ranks = list(range(first, first + tp_size))
            group = dist.new_group(ranks, backend=backend) if tp_size > 1 else None
            if other == replica and stage == pp_rank:
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
    ep = None
    if replicas > 1:
        ep = TensorParallelGroup(replica * world + rank, replicas * world, dist.group.WORLD)
    return RankGroups(rank, TensorParallelGroup(tp_rank, tp_size, tp_group), pp, ep)
