"""Grouping a batch's (token, expert) pairs by expert: one stable sort, no loop over tokens.

A token routed to ``top_k`` experts makes ``top_k`` slots; slot ``s`` is token ``s // top_k``'s
``s % top_k``-th choice. Sorting the slots by expert puts each expert's tokens next to each other,
so each expert runs one matmul over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertGroups:
    """A batch's slots sorted by local expert.

    ``order [slots]``: slot ids, by expert (the slots of experts not held here last);
    ``counts [num_local_experts]``: how many slots each local expert owns, in that order.
    """

    order: torch.Tensor
    counts: torch.Tensor
    local_ids: torch.Tensor  # [slots] local expert of each slot, num_local_experts where not held


def local_expert_ids(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None
) -> torch.Tensor:
    """``[slots]`` local expert of each slot; ``num_local_experts`` for experts another rank holds
    (``expert_map[global] == -1``)."""
    flat = topk_ids.reshape(-1).long()
    if expert_map is None:
        return flat
    local = expert_map.long()[flat]
    return torch.where(local < 0, num_local_experts, local)


def group_by_expert(
    topk_ids: torch.Tensor, num_local_experts: int, expert_map: torch.Tensor | None = None
) -> ExpertGroups:
    """Sort the slots of ``topk_ids [tokens, top_k]`` by the local expert they go to."""
    local = local_expert_ids(topk_ids, num_local_experts, expert_map)
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local, minlength=num_local_experts + 1)[:num_local_experts]
    return ExpertGroups(order, counts, local)


def check_expert_args(
    hidden: torch.Tensor,
    w13_shapes: list[tuple[int, ...]],
    w2_shapes: list[tuple[int, ...]],
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
) -> None:
    """ValueError naming the argument whose shape does not fit."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [tokens, hidden], got {tuple(hidden.shape)}")
    if len(w13_shapes) != len(w2_shapes) or not w13_shapes:
        raise ValueError(
            f"w2: {len(w2_shapes)} experts, w13 has {len(w13_shapes)} (at least one each)"
        )
    size = hidden.shape[1]
    for e, (s13, s2) in enumerate(zip(w13_shapes, w2_shapes)):
        if len(s13) != 2 or s13[1] != size or s13[0] % 2:
            raise ValueError(f"w13: expert {e} is {s13}, expected [2 * intermediate, {size}]")
        if tuple(s2) != (size, s13[0] // 2):
            raise ValueError(f"w2: expert {e} is {tuple(s2)}, expected ({size}, {s13[0] // 2})")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"topk_ids: expected [{hidden.shape[0]}, top_k], got {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights: shape {tuple(topk_weights.shape)} differs from topk_ids' "
            f"{tuple(topk_ids.shape)}"
        )
    if expert_map is not None and expert_map.dim() != 1:
        raise ValueError(f"expert_map: expected [num_experts], got {tuple(expert_map.shape)}")
