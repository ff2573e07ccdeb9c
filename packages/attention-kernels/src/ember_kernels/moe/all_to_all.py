"""Expert-parallel dispatch and combine over ``torch.distributed`` all-to-all.

Each rank of an expert-parallel group brings its own tokens and their routing (``topk_ids``,
global expert ids; ``topk_weights``). ``dispatch`` sends every (token, choice) slot's hidden row
to the rank owning that expert (``ExpertPlacement``), with the expert's local index there;
the receiving rank runs its experts over what arrived (``fused_experts`` with one unit-weight
choice per row); ``combine`` sends each result back to the rank it came from, which weights the
results and sums them into their tokens. Split sizes are exchanged first, so any rank may send
or receive any number of rows, zero included. Collectives run on the group's backend: gloo for
CPU tensors, nccl for CUDA ones.

``gather_token_slices`` undoes ``token_slice`` for ranks that started from the same replicated
tokens (tensor-parallel attention): each rank took its slice, and every rank gets all of them
back in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ember_kernels.moe.placement import ExpertPlacement
from ember_kernels.moe.torch_experts import ExpertWeights


@dataclass
class Dispatched:
    """What a rank received in ``dispatch``, and what ``combine`` needs to send results home.

    ``rows [received, hidden]`` and ``local_ids [received]`` (the expert's index on this rank)
    are the experts' input; the rest is the route back.
    """

    rows: torch.Tensor
    local_ids: torch.Tensor
    order: torch.Tensor  # [sent] the slots of this rank's tokens, in the order they were sent
    send_counts: list[int]
    recv_counts: list[int]


class AllToAllDispatcher:
    """Dispatch and combine for one rank (``rank`` of ``placement.size``) over ``group``."""

    def __init__(
        self, placement: ExpertPlacement, rank: int, group: dist.ProcessGroup | None = None
    ) -> None:
        if placement.size > 1 and group is None:
            raise ValueError(f"group: an expert-parallel group of {placement.size} ranks needs one")
        self.placement = placement
        self.rank = rank
        self.group = group
        self._owners = placement.owners()
        self._local = placement.local_indices()

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor) -> Dispatched:
        """Send each slot of ``topk_ids [tokens, top_k]`` to its expert's rank."""
        size, top_k = self.placement.size, topk_ids.shape[1]
        flat = topk_ids.reshape(-1).long()
        if self._owners.device != flat.device:  # moved once, not every layer and step
            self._owners, self._local = self._owners.to(flat.device), self._local.to(flat.device)
        owners = self._owners[flat]
        order = torch.argsort(owners, stable=True)
        send_counts_t = torch.bincount(owners, minlength=size)
        local_ids = self._local[flat].index_select(0, order)
        rows = hidden.index_select(0, order // top_k)
        if size == 1:
            count = [int(order.numel())]
            return Dispatched(rows, local_ids, order, count, count)
        recv_counts_t = torch.empty_like(send_counts_t)
        dist.all_to_all_single(recv_counts_t, send_counts_t, group=self.group)
        send_counts, recv_counts = send_counts_t.tolist(), recv_counts_t.tolist()
        received = sum(recv_counts)
        recv_rows = hidden.new_empty((received, hidden.shape[1]))
        dist.all_to_all_single(recv_rows, rows, recv_counts, send_counts, group=self.group)
        recv_ids = local_ids.new_empty(received)
        dist.all_to_all_single(recv_ids, local_ids, recv_counts, send_counts, group=self.group)
        return Dispatched(recv_rows, recv_ids, order, send_counts, recv_counts)

    def combine(
        self, results: torch.Tensor, dispatched: Dispatched, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """``[tokens, hidden]``: each of this rank's tokens' expert results (``results`` rows
        answer ``dispatched.rows``) weighted by ``topk_weights`` and summed."""
        if self.placement.size == 1:
            back = results
        else:
            back = results.new_empty((sum(dispatched.send_counts), results.shape[1]))
            dist.all_to_all_single(
                back, results, dispatched.send_counts, dispatched.recv_counts, group=self.group
            )
        num_tokens, top_k = topk_weights.shape
        order = dispatched.order
        weights = topk_weights.reshape(-1).index_select(0, order).to(back.dtype).unsqueeze(1)
        out = back.new_zeros((num_tokens, back.shape[1]))
        return out.index_add_(0, order // top_k, back * weights)


def run_local_experts(
    dispatched: Dispatched, w13: ExpertWeights, w2: ExpertWeights
) -> torch.Tensor:
    """The experts of this rank over the rows it received, unweighted, one row per slot."""
    from ember_kernels.moe import fused_experts

    ids = dispatched.local_ids.unsqueeze(1)
    if ids.shape[0] == 0:  # nothing arrived: no expert runs (kernels need not take empty inputs)
        return torch.empty_like(dispatched.rows)
    ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
    return fused_experts(dispatched.rows, w13, w2, ones, ids)


def expert_parallel_experts(
    hidden: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    dispatcher: AllToAllDispatcher,
) -> torch.Tensor:
    """``fused_experts`` of this rank's tokens with the experts spread over the group: dispatch,
    this rank's experts (``w13``/``w2`` hold its share, in ``local_experts`` order), combine."""
    dispatched = dispatcher.dispatch(hidden, topk_ids)
    return dispatcher.combine(run_local_experts(dispatched, w13, w2), dispatched, topk_weights)


def token_slice(num_tokens: int, rank: int, size: int) -> slice:
    """The rows of ``num_tokens`` replicated tokens that ``rank`` of ``size`` takes: balanced
    contiguous slices, some of them empty when there are fewer tokens than ranks."""
    return slice(num_tokens * rank // size, num_tokens * (rank + 1) // size)


def gather_token_slices(
    part: torch.Tensor, num_tokens: int, size: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``[num_tokens, ...]``: every rank's ``token_slice`` rows, in rank order, on every rank."""
    if size == 1:
        return part
    # all_gather wants equal shapes: each slice is padded to the longest.
    longest = -(-num_tokens // size)
    padded = part.new_zeros((longest, *part.shape[1:]))
    padded[: part.shape[0]] = part
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    bounds = [token_slice(num_tokens, r, size) for r in range(size)]
    return torch.cat([p[: b.stop - b.start] for p, b in zip(parts, bounds)])
