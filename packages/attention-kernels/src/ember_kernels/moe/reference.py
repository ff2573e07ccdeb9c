"""Plain references for the mixture-of-experts ops: every expert on every token, and a per-token
loop for routing. Slow and obviously right; the tests run them in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])`` with
    ``expert_e(x) = w2[e] (silu(x w1[e]^T) * x w3[e]^T)`` and ``w13[e] = [w1[e]; w3[e]]``.
    With ``expert_map``, global ids mapping to -1 contribute nothing."""
    outputs = []
    for e in range(w13.shape[0]):
        gate, up = F.linear(hidden, w13[e]).chunk(2, dim=-1)
        outputs.append(F.linear(F.silu(gate) * up, w2[e]))
    every = torch.stack(outputs, dim=1)  # [tokens, experts, hidden]
    ids = topk_ids.long()
    weights = topk_weights.to(hidden.dtype)
    if expert_map is not None:
        local = expert_map.long()[ids]
        weights = weights * (local >= 0)
        ids = local.clamp(min=0)
    chosen = every.gather(1, ids.unsqueeze(-1).expand(-1, -1, hidden.shape[1]))
    return (chosen * weights.unsqueeze(-1)).sum(dim=1)


def select_experts_reference(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[list[set[int]], torch.Tensor]:
    """Each token's chosen expert set and a ``[tokens, num_experts]`` weight per expert (zero where
    not chosen), one token at a time in float64."""
    chosen, weights = [], torch.zeros(router_logits.shape, dtype=torch.float64)
    num_experts = router_logits.shape[1]
    for t, row in enumerate(router_logits.double()):
        scores = row.softmax(-1) if scoring == "softmax" else row.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.double()
        allowed = list(range(num_experts))
        if num_expert_group and num_expert_group > 1:
            size = num_experts // num_expert_group
            groups = [choice[g * size : (g + 1) * size] for g in range(num_expert_group)]
            if correction_bias is None:
                rank = [float(g.max()) for g in groups]
            else:
                rank = [float(g.sort(descending=True).values[:2].sum()) for g in groups]
            best = sorted(range(num_expert_group), key=lambda g: -rank[g])[:topk_group]
            allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
        picked = sorted(allowed, key=lambda e: -float(choice[e]))[:top_k]
        total = sum(float(scores[e]) for e in picked)
        for e in picked:
            w = float(scores[e]) / (total + 1e-20) if renormalize else float(scores[e])
            weights[t, e] = w * routed_scaling_factor
        chosen.append(set(picked))
    return chosen, weights
