"""Batched logits transforms of the sampler: penalties, min-p, top-k and top-p.

Each works on ``[num_reqs, vocab]`` float32 logits with one parameter per row, in place where it
says so, and leaves rows whose parameter is neutral unchanged.
"""

from __future__ import annotations

import torch


def apply_penalties_(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,
    prompt_token_mask: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties, in place.

    Repetition (over prompt and output tokens): a seen token's positive logit is divided by the
    penalty, a negative one multiplied. Frequency and presence (over output tokens only): subtract
    ``frequency × count`` and ``presence × [count > 0]``.
    """
    in_output = output_token_counts > 0
    seen = in_output | prompt_token_mask
    rep = repetition_penalties[:, None].expand_as(logits)
    scale = torch.where(logits > 0, 1.0 / rep, rep)
    logits.mul_(torch.where(seen, scale, torch.ones_like(scale)))
    logits.sub_(frequency_penalties[:, None] * output_token_counts)
    logits.sub_(presence_penalties[:, None] * in_output)
    return logits


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the k-th kept), then the smallest
    set of most likely tokens whose probability reaches ``top_p`` (at least one token)."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).to(torch.int64)
        kth_largest = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p)[:, None]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
