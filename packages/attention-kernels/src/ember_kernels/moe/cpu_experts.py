"""The routed experts of a few tokens on the CPU, in one compiled call (``cpu_ops.moe_experts``).

Decoding routes one to a few dozen tokens per layer, so each expert's matmuls in the torch path
(``torch_experts``) have a row or two each: their calls, with the gather, sort and index_add
around them, cost more than their arithmetic. The compiled kernel runs every (token, expert) slot
as dot products over the stacked weights, each weight row read once for all its slots, and sums
in float32. Past ``COMPILED_MAX_TOKENS`` the torch path's batched matmuls win
(``benchmarks/bench_fused_moe.py``).
"""

from __future__ import annotations

import torch

from ember_kernels import cpu_ops
from ember_kernels.moe.grouping import local_expert_ids

# Tokens per call at or below which the compiled kernel beats one matmul per expert.
COMPILED_MAX_TOKENS = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def runs_compiled(hidden: torch.Tensor, w13, w2) -> bool:
    """Whether the compiled kernel serves this call: a few CPU tokens, stacked weights of the
    hidden's dtype (float32, bfloat16 or float16), the kernels built here."""
    return (
        isinstance(w13, torch.Tensor)
        and isinstance(w2, torch.Tensor)
        and hidden.device.type == "cpu"
        and hidden.dtype in DTYPES
        and w13.dtype == hidden.dtype == w2.dtype
        and 0 < hidden.shape[0] <= COMPILED_MAX_TOKENS
        and cpu_ops.available()
    )


def keeps_stacked_weights(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether the kernel will serve decoding on these stacked CPU weights (float32, bfloat16 or
    float16), so that they should stay stacked: true while the kernels are still being built in
    the background too (asked at load, which must not wait for the compiler)."""
    return (
        w13.device.type == "cpu"
        and w13.dtype in DTYPES
        and w13.dtype == w2.dtype
        and cpu_ops.available_or_building()
    )


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``ember_kernels.moe.fused_experts`` (arguments already checked)."""
    local = topk_ids
    if expert_map is not None:
        local = local_expert_ids(topk_ids, w13.shape[0], expert_map).view(topk_ids.shape)
    return cpu_ops.moe_experts(hidden, w13, w2, topk_weights, local)
