"""Rotary position embedding applied from a cos/sin cache, in torch."""

from __future__ import annotations

import torch


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate the first ``rotary_dim`` dims of every head of ``query`` (and ``key``).

    ``cos_sin_cache [max_position, rotary_dim]`` holds ``cos`` in its first half and ``sin`` in
    its second (one entry per rotated pair). ``query``/``key`` are
    ``[num_tokens, heads, head_size]``. Returns new tensors; the inputs are left unchanged.
    """
    cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    rotary_dim = cos_sin_cache.shape[-1]
    return (
        _rotate(query, cos, sin, rotary_dim, is_neox_style),
        None if key is None else _rotate(key, cos, sin, rotary_dim, is_neox_style),
    )


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox_style: bool
) -> torch.Tensor:
    out = torch.empty_like(x)
    half = rotary_dim // 2
    if is_neox_style:
        x1, x2 = x[..., :half], x[..., half:rotary_dim]
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rotary_dim] = x2 * cos + x1 * sin
    else:
        x1, x2 = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out[..., 0:rotary_dim:2] = x1 * cos - x2 * sin
        out[..., 1:rotary_dim:2] = x2 * cos + x1 * sin
    if rotary_dim < x.shape[-1]:
        out[..., rotary_dim:] = x[..., rotary_dim:]
    return out
