"""The experts of a mixture-of-experts layer in torch: one matmul per expert over its tokens.

Slots are sorted by expert (``grouping``), the hidden rows gathered once in that order, and each
expert with tokens runs its fused gate/up projection, SiLU-and-mul and down projection over its
contiguous run of rows; the rows are weighted and summed back into their tokens by one
``index_add_``. The loop is over experts, never tokens, and the only host sync is reading the
per-expert counts. Expert weights may be one ``[experts, out, in]`` tensor or a sequence of
per-expert ``[out, in]`` weights, each plain or packed for oneDNN
(``ember_kernels.packed_linear``), so the CPU runs the same packed matmuls as the dense layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember_kernels import ops
from ember_kernels.moe.grouping import group_by_expert
from ember_kernels.packed_linear import linear

ExpertWeights = torch.Tensor | Sequence[torch.Tensor]


def fused_experts(
    hidden: torch.Tensor,
    w13: ExpertWeights,
    w2: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[tokens, hidden]``: each token's experts' outputs weighted by ``topk_weights`` and summed
    (same contract as ``ember_kernels.moe.fused_experts``)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(hidden)
    if num_tokens == 0:
        return out
    groups = group_by_expert(topk_ids, len(w13), expert_map)
    counts = groups.counts.tolist()
    held = sum(counts)
    order = groups.order[:held]
    tokens = order // top_k
    rows = hidden.index_select(0, tokens)
    weights = topk_weights.reshape(-1).index_select(0, order).to(hidden.dtype).unsqueeze(1)
    results = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            part = slice(start, start + count)
            act = ops.silu_and_mul(linear(rows[part], w13[expert]))
            results[part] = linear(act, w2[expert])
            start += count
    return out.index_add_(0, tokens, results * weights)
