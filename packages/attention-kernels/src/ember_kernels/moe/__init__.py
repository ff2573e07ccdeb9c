"""Mixture-of-experts ops: routing, and the experts run grouped by expert, tensors in and out.

``select_experts`` turns router logits into each token's experts and weights; ``fused_experts``
runs the experts over their tokens and combines the results; ``fused_moe`` does both. CUDA
tensors run the Triton kernel (``ember_kernels.triton_ops.fused_moe``), a few CPU tokens on stacked
weights the compiled kernel (``ember_kernels.moe.cpu_experts``), other tensors the torch path
(``ember_kernels.moe.torch_experts``), which also takes per-expert weights packed for oneDNN.
Expert parallelism: ``ExpertPlacement`` says which rank holds which expert, and
``AllToAllDispatcher`` (``expert_parallel_experts``) sends tokens to their experts' ranks and the
results back over ``torch.distributed`` all-to-all.
"""

from __future__ import annotations

import torch

from ember_kernels.moe import cpu_experts
from ember_kernels.moe.all_to_all import (
    AllToAllDispatcher,
    expert_parallel_experts,
    gather_token_slices,
    token_slice,
)
from ember_kernels.moe.grouping import check_expert_args
from ember_kernels.moe.placement import PLACEMENT_STRATEGIES, ExpertPlacement
from ember_kernels.moe.routing import select_experts
from ember_kernels.moe.torch_experts import ExpertWeights
from ember_kernels.moe.torch_experts import fused_experts as _torch_fused_experts

__all__ = [
    "PLACEMENT_STRATEGIES",
    "AllToAllDispatcher",
    "ExpertPlacement",
    "expert_parallel_experts",
    "fused_experts",
    "fused_moe",
    "gather_token_slices",
    "select_experts",
    "token_slice",
]


def fused_experts(
    hidden: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``, ``[tokens,
    hidden]``, where ``expert_e(x) = w2[e] @ (silu(w1[e] @ x) * (w3[e] @ x))``.

    ``w13``: ``[experts, 2 * intermediate, hidden]`` (gate rows, then up rows) or one such
    ``[out, in]`` weight per expert; ``w2``: ``[experts, hidden, intermediate]`` likewise (per-expert
    weights may be packed for oneDNN, CPU only). ``expert_map [num_global_experts]`` maps a
    global expert id to its index in ``w13``/``w2``, -1 for experts held elsewhere (expert
    parallelism): their slots add nothing here.
    """
    packed = not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor)
    check_expert_args(hidden, *_expert_shapes(w13, w2), topk_weights, topk_ids, expert_map)
    if hidden.is_cuda and not packed:
        from ember_kernels.triton_ops.fused_moe import fused_experts as triton_fused_experts

        return triton_fused_experts(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    if cpu_experts.runs_compiled(hidden, w13, w2):
        return cpu_experts.fused_experts(hidden, w13, w2, topk_weights, topk_ids, expert_map)
    return _torch_fused_experts(hidden, w13, w2, topk_weights, topk_ids, expert_map)


def fused_moe(
    hidden: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    expert_map: torch.Tensor | None = None,
    **routing,
) -> torch.Tensor:
    """``fused_experts`` of the experts ``select_experts(router_logits, top_k, **routing)``
    chooses."""
    topk_weights, topk_ids = select_experts(router_logits, top_k, **routing)
    return fused_experts(hidden, w13, w2, topk_weights, topk_ids, expert_map=expert_map)


def _expert_shapes(w13: ExpertWeights, w2: ExpertWeights) -> tuple[list, list]:
    """The experts' ``[out, in]`` shapes to check (a oneDNN-packed weight keeps its logical
    shape). Stacked tensors are checked once, not per expert: this runs every layer and step."""
    if isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor):
        if w13.dim() != 3 or w2.dim() != 3:
            raise ValueError(
                f"w13, w2: expected [experts, out, in] tensors, got {tuple(w13.shape)} and "
                f"{tuple(w2.shape)}"
            )
        if w13.shape[0] != w2.shape[0]:
            raise ValueError(f"w2: {w2.shape[0]} experts, w13 has {w13.shape[0]}")
        return [tuple(w13.shape[1:])], [tuple(w2.shape[1:])]
    return [tuple(w.shape) for w in w13], [tuple(w.shape) for w in w2]
