"""Mamba-2 in vectorized torch, over a flat batch of variable-length requests.

Tokens of every request are concatenated (``query_start_loc`` marks where each starts, as for
paged attention); each request owns a slot of the state tensors (``state_indices``) that holds
its causal-convolution window and its SSM state between calls, so a request may arrive in
several chunks. ``has_initial_state`` is False for a request's first chunk: its slot is then
read as zeros (whatever an earlier owner left there).

- ``causal_conv1d_varlen``: the depthwise causal convolution with its carried window.
- ``selective_state_update``: one token per request (decode), the recurrence in one update.
- ``ssd_chunk_scan_varlen``: several tokens per request (prefill), the state-space dual form by
  chunks: within a chunk a masked ``(C B^T) * decay`` product, between chunks a recurrence over
  the chunks' summed states, written as one matrix product over the chunk axis.

No loop runs over tokens or requests; arithmetic is in float32.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _token_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request of each flat token."""
    lengths = (query_start_loc[1:] - query_start_loc[:-1]).long()
    rows = torch.arange(lengths.shape[0], device=lengths.device)
    return rows.repeat_interleave(lengths, output_size=num_tokens)


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal convolution of each request's tokens, continuing from its window.

    ``x`` [num_tokens, channels]; ``weight`` [channels, width]; ``conv_states``
    [num_slots, channels, width - 1], the last ``width - 1`` inputs of each slot's request,
    updated in place; ``state_indices`` [num_reqs]; ``query_start_loc`` [num_reqs + 1]
    (every request at least one token); ``has_initial_state`` [num_reqs] bool. Returns
    [num_tokens, channels] (after SiLU with ``activation="silu"``).
    """
    num_tokens, channels = x.shape
    width = weight.shape[1]
    history = width - 1
    num_reqs = state_indices.shape[0]
    rows = _token_rows(query_start_loc, num_tokens)
    # Each request's window before its tokens, then its tokens: one extended sequence in which
    # request r's tokens sit (r + 1) * history places further on than in x.
    # where, not a product: a fresh slot's memory may hold NaN or inf, and NaN * 0 is NaN.
    initial = conv_states[state_indices].to(x.dtype)
    initial = torch.where(has_initial_state.bool()[:, None, None], initial, 0)
    token_at = torch.arange(num_tokens, device=x.device) + (rows + 1) * history
    starts = query_start_loc[:-1].long() + torch.arange(num_reqs, device=x.device) * history
    window_at = starts[:, None] + torch.arange(history, device=x.device)[None]
    extended = x.new_empty(num_tokens + num_reqs * history, channels)
    extended[token_at] = x
    extended[window_at.reshape(-1)] = initial.transpose(1, 2).reshape(-1, channels)
    taps = extended[token_at[None] - history + torch.arange(width, device=x.device)[:, None]]
    out = torch.einsum("wtc,cw->tc", taps.float(), weight.float())
    if bias is not None:
        out = out + bias.float()
    ends = query_start_loc[1:].long() + (torch.arange(num_reqs, device=x.device) + 1) * history
    last = extended[ends[:, None] - history + torch.arange(history, device=x.device)[None]]
    conv_states[state_indices] = last.transpose(1, 2).to(conv_states.dtype)
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    return out.to(x.dtype)


def _discretized_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]
) -> torch.Tensor:
    return F.softplus(dt.float() + dt_bias.float()).clamp(dt_limit[0], dt_limit[1])


def _per_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., groups, state] -> [..., heads, state]: each group serves ``heads / groups`` heads."""
    groups = t.shape[-2]
    return t.float().repeat_interleave(num_heads // groups, dim=-2, output_size=num_heads)


def selective_state_update(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """One token per request: ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x``.

    ``ssm_states`` [num_slots, heads, head_dim, state] updated in place; ``x`` [num_reqs,
    heads, head_dim]; ``dt`` [num_reqs, heads] (before ``dt_bias`` and softplus); ``A``,
    ``D``, ``dt_bias`` [heads]; ``B``, ``C`` [num_reqs, groups, state]. Returns ``y`` like
    ``x``."""
    num_heads = x.shape[1]
    dt = _discretized_dt(dt, dt_bias, dt_limit)  # [R, H]
    decay = torch.exp(dt * A.float())
    xf = x.float()
    # The state is the one large tensor: gathered once, updated in place, scattered once.
    state = ssm_states[state_indices].to(torch.float32, copy=True)
    if has_initial_state is not None:  # a fresh request's slot is read as zeros (where: NaN * 0)
        state = torch.where(has_initial_state.bool()[:, None, None, None], state, 0)
    state.mul_(decay[:, :, None, None]).addcmul_(
        (dt[:, :, None] * xf)[..., None], _per_head(B, num_heads)[:, :, None, :]
    )
    ssm_states[state_indices] = state.to(ssm_states.dtype)
    y = torch.einsum("rhpn,rhn->rhp", state, _per_head(C, num_heads))
    return (y + D.float()[:, None] * xf).to(x.dtype)


def ssd_chunk_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """Several tokens per request, by chunks of ``chunk_size``, from each slot's state.

    ``x`` [num_tokens, heads, head_dim]; ``dt`` [num_tokens, heads]; ``B``, ``C``
    [num_tokens, groups, state]; the rest as in ``selective_state_update``, with
    ``query_start_loc`` [num_reqs + 1]. Requests are padded to one length, a multiple of
    ``chunk_size``; a padding step has ``dt = 0`` (no decay, no input), so each request's final
    state is its last token's. Returns ``y`` like ``x``; each slot ends with its final state.
    """
    num_tokens, num_heads, head_dim = x.shape
    num_reqs = state_indices.shape[0]
    lengths = (query_start_loc[1:] - query_start_loc[:-1]).long()
    longest = int(lengths.max())
    padded = -(-longest // chunk_size) * chunk_size
    num_chunks = padded // chunk_size
    rows = _token_rows(query_start_loc, num_tokens)
    cols = torch.arange(num_tokens, device=x.device) - query_start_loc[:-1].long()[rows]

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(num_reqs, padded, *t.shape[1:])
        out[rows, cols] = t
        return out.view(num_reqs, num_chunks, chunk_size, *t.shape[1:])

    dt = pad(_discretized_dt(dt, dt_bias, dt_limit))  # [R, c, l, H]; 0 at padding
    xs = pad(x.float())  # [R, c, l, H, P]
    Bh, Ch = pad(_per_head(B, num_heads)), pad(_per_head(C, num_heads))  # [R, c, l, H, N]
    log_decay = torch.cumsum(dt * A.float(), dim=2)  # [R, c, l, H], non-increasing in l
    xdt = xs * dt[..., None]

    # Within a chunk: y_i += sum_{j <= i} (C_i . B_j) exp(a_i - a_j) dt_j x_j.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    gaps = log_decay[:, :, :, None, :] - log_decay[:, :, None, :, :]  # [R, c, i, j, H]
    weights = torch.exp(gaps.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    scores = torch.einsum("rcihn,rcjhn->rcijh", Ch, Bh) * weights
    y = torch.einsum("rcijh,rcjhp->rcihp", scores, xdt)

    # Each chunk's own contribution to the state at its end, then the state entering each chunk:
    # entering[k] = sum_{z <= k} exp(T_k - T_z) summed[z], summed = [initial, chunk 0, ...], T the
    # running total of the chunks' log decays.
    to_end = torch.exp(log_decay[:, :, -1:, :] - log_decay)  # [R, c, l, H]
    chunk_states = torch.einsum("rclhn,rclhp->rchpn", Bh * to_end[..., None], xdt)
    initial = ssm_states[state_indices].float()
    initial = torch.where(has_initial_state.bool()[:, None, None, None], initial, 0)
    summed = torch.cat([initial[:, None], chunk_states], dim=1)  # [R, c + 1, H, P, N]
    totals = F.pad(torch.cumsum(log_decay[:, :, -1, :], dim=1), (0, 0, 1, 0))  # [R, c + 1, H]
    steps = torch.ones(num_chunks + 1, num_chunks + 1, dtype=torch.bool, device=x.device).tril()
    between = totals[:, :, None, :] - totals[:, None, :, :]  # [R, k, z, H]
    carry = torch.exp(between.masked_fill(~steps[None, :, :, None], float("-inf")))
    entering = torch.einsum("rkzh,rzhpn->rkhpn", carry, summed)  # [R, c + 1, H, P, N]
    ssm_states[state_indices] = entering[:, -1].to(ssm_states.dtype)

    # From the state entering a chunk: y_i += exp(a_i) C_i . h.
    y = (
        y
        + torch.einsum("rclhn,rchpn->rclhp", Ch, entering[:, :-1]) * torch.exp(log_decay)[..., None]
    )
    y = y.reshape(num_reqs, padded, num_heads, head_dim)[rows, cols]
    return (y + D.float()[:, None] * x.float()).to(x.dtype)
