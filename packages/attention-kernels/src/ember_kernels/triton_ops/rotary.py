"""Rotary embedding in Triton: one program per token rotates all heads of its query and key."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember_kernels.validation import check_head_dim_contiguous


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    token,
    stride_st,
    stride_sh,
    stride_dt,
    stride_dh,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    pairs = tl.arange(0, PAIRS_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (pairs < ROTARY_DIM // 2)
    if IS_NEOX:
        first = pairs
        second = pairs + ROTARY_DIM // 2
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    src = src_ptr + token * stride_st + heads * stride_sh
    dst = dst_ptr + token * stride_dt + heads * stride_dh
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
    if ROTARY_DIM < HEAD_SIZE:
        rest = ROTARY_DIM + tl.arange(0, PASS_PAD)[None, :]
        rest_mask = (heads < NUM_HEADS) & (rest < HEAD_SIZE)
        tl.store(dst + rest, tl.load(src + rest, mask=rest_mask), mask=rest_mask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    query_ptr,
    key_ptr,
    positions_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_KEY: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, PAIRS_PAD)[None, :]
    pair_ok = pairs < ROTARY_DIM // 2
    row = cache_ptr + position * ROTARY_DIM
    cos = tl.load(row + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    sin = tl.load(row + ROTARY_DIM // 2 + pairs, mask=pair_ok, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
        NUM_Q_HEADS, HEAD_SIZE, ROTARY_DIM, Q_HEADS_PAD, PAIRS_PAD, PASS_PAD, IS_NEOX,
    )  # fmt: skip
    if HAS_KEY:
        _rotate_heads(
            key_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
            NUM_K_HEADS, HEAD_SIZE, ROTARY_DIM, K_HEADS_PAD, PAIRS_PAD, PASS_PAD, IS_NEOX,
        )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton rotary embedding (same contract as ``ember_kernels.torch_ops.rotary_embedding``)."""
    check_head_dim_contiguous(query=query, key=key)
    num_tokens, num_q_heads, head_size = query.shape
    rotary_dim = cos_sin_cache.shape[-1]
    q_out = torch.empty_like(query)
    k_out = None if key is None else torch.empty_like(key)
    if num_tokens == 0:
        return q_out, k_out
    key_arg = query if key is None else key
    k_out_arg = q_out if k_out is None else k_out
    _rotary_kernel[(num_tokens,)](
        q_out,
        k_out_arg,
        query,
        key_arg,
        positions,
        cos_sin_cache.contiguous(),
        query.stride(0),
        query.stride(1),
        key_arg.stride(0),
        key_arg.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out_arg.stride(0),
        k_out_arg.stride(1),
        NUM_Q_HEADS=num_q_heads,
        NUM_K_HEADS=key_arg.shape[1],
        HEAD_SIZE=head_size,
        ROTARY_DIM=rotary_dim,
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
        K_HEADS_PAD=triton.next_power_of_2(key_arg.shape[1]),
        PAIRS_PAD=triton.next_power_of_2(rotary_dim // 2),
        PASS_PAD=triton.next_power_of_2(max(head_size - rotary_dim, 1)),
        IS_NEOX=is_neox_style,
        HAS_KEY=key is not None,
    )
    return q_out, k_out
