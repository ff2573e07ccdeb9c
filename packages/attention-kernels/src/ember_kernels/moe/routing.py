"""Expert selection for mixture-of-experts layers: scores, (grouped) top-k and the weights.

Covers the routers of Mixtral and Qwen-MoE (softmax, top-k, optional renormalization), DeepSeek-V2
(softmax, top-k within the best ``topk_group`` of ``num_expert_group`` groups, a group scored by
its best expert) and DeepSeek-V3 (sigmoid scores; the choice, and the groups scored by the sum of
their two best, use the scores plus a correction bias, the weights the scores without it).
Everything is vectorized over tokens; the weights come out in float32. Plain softmax routing of CPU
tensors runs the compiled ``cpu_ops.moe_topk_softmax`` where it is built (one call instead of the
torch path's softmax, top-k, gather and renormalization); the choice is the same up to ties.
"""

from __future__ import annotations

import torch

from ember_kernels import cpu_ops

SCORING_FUNCTIONS = ("softmax", "sigmoid")


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [tokens, top_k] float32, topk_ids [tokens, top_k] int64)`` for
    ``router_logits [tokens, num_experts]``.

    ``renormalize`` divides each token's chosen weights by their sum; ``routed_scaling_factor``
    multiplies them last. ``num_expert_group``/``topk_group`` restrict each token to the experts of
    its ``topk_group`` best groups. ``correction_bias [num_experts]`` shifts the scores used for
    choosing (groups and experts), not the weights.
    """
    _check_routing(router_logits, top_k, scoring, num_expert_group, topk_group, correction_bias)
    if _runs_compiled(router_logits, scoring, num_expert_group, correction_bias):
        topk_weights, topk_ids = cpu_ops.moe_topk_softmax(router_logits, top_k, renormalize)
        if routed_scaling_factor != 1.0:
            topk_weights = topk_weights * routed_scaling_factor
        return topk_weights, topk_ids
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        choice = _mask_to_best_groups(choice, num_expert_group, topk_group, correction_bias)
    topk_ids = torch.topk(choice, top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    return topk_weights, topk_ids


def _runs_compiled(logits, scoring, num_groups, correction_bias) -> bool:
    """Plain softmax routing of CPU logits runs in one compiled call where the kernels are built
    (a decode step's few tokens would spend more on the torch path's seven small ops)."""
    return (
        scoring == "softmax"
        and (num_groups is None or num_groups <= 1)
        and correction_bias is None
        and logits.device.type == "cpu"
        and logits.dtype in cpu_ops.DTYPES
        and cpu_ops.available()
    )


def _mask_to_best_groups(
    choice: torch.Tensor, num_groups: int, topk_group: int, correction_bias: torch.Tensor | None
) -> torch.Tensor:
    """``choice`` with the experts outside each token's ``topk_group`` best groups at -inf."""
    tokens, num_experts = choice.shape
    grouped = choice.view(tokens, num_groups, num_experts // num_groups)
    if correction_bias is None:
        group_scores = grouped.max(dim=-1).values
    else:  # DeepSeek-V3: a group is as good as its two best experts together
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best = torch.topk(group_scores, topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, num_experts)


def _check_routing(logits, top_k, scoring, num_groups, topk_group, correction_bias) -> None:
    if logits.dim() != 2:
        raise ValueError(
            f"router_logits: expected [tokens, num_experts], got {tuple(logits.shape)}"
        )
    num_experts = logits.shape[1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: must be in [1, {num_experts}], got {top_k}")
    if scoring not in SCORING_FUNCTIONS:
        raise ValueError(f"scoring: must be one of {SCORING_FUNCTIONS}, got {scoring!r}")
    if num_groups is not None and num_groups > 1:
        if num_experts % num_groups:
            raise ValueError(
                f"num_expert_group: {num_groups} does not divide num_experts {num_experts}"
            )
        if topk_group is None or not 1 <= topk_group <= num_groups:
            raise ValueError(f"topk_group: must be in [1, {num_groups}], got {topk_group}")
        if topk_group * (num_experts // num_groups) < top_k:
            raise ValueError(
                f"topk_group: {topk_group} groups of {num_experts // num_groups} experts hold "
                f"fewer than top_k={top_k}"
            )
    if correction_bias is not None and correction_bias.shape != (num_experts,):
        raise ValueError(
            f"correction_bias: expected shape ({num_experts},), got {tuple(correction_bias.shape)}"
        )
