"""Unified paged attention in Triton: prefill, chunked prefill and decode in one launch.

Each program owns one sequence, a tile of ``BLOCK_Q`` of its query tokens and one KV head; the
``GROUP`` query heads that share that KV head are folded into the tile's rows
(``BLOCK_M = BLOCK_Q * GROUP_PAD``), so every key and value is loaded once per KV head. The
program walks the visible KV range ``TILE_N`` positions at a time (several pages per step),
looking each position's page up in the block table, with an online softmax in float32.

Split-KV: with ``num_kv_splits > 1`` a third grid axis cuts the KV range of every program into
that many contiguous parts; each part writes an unnormalised partial result (max, sum, weighted
values) and a second kernel merges them. Decode batches too small to fill the GPU use it.

Loads are converted to float32 at once (the interpreter keeps bf16 as raw integers; on the GPU
fp16/bf16 values are exact in TF32, so the dots lose nothing); dots on float32 inputs run in IEEE
precision so that they match the float32 CPU path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ember_kernels.validation import check_head_dim_contiguous, check_paged_attention_args

MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on NVIDIA GPUs


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1) saturates cleanly to +-1 at both ends without overflow to NaN.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale,
    soft_cap,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context_len = seq_len - q_len  # position of the sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD  # token index within the sequence
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    query_pos = context_len + token
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_SIZE
    q = tl.load(
        query_ptr
        + (q_start + token)[:, None] * stride_qt
        + head[:, None] * stride_qh
        + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(tl.float32)

    # The KV positions any row of this tile can see, cut into NUM_SPLITS parts of whole tiles.
    kv_end = tl.minimum(context_len + (q_tile + 1) * BLOCK_Q, seq_len)
    if USE_WINDOW:
        first_visible = tl.maximum(context_len + q_tile * BLOCK_Q - sliding_window + 1, 0)
        kv_begin = (first_visible // TILE_N) * TILE_N
    else:
        kv_begin = 0
    num_tiles = tl.cdiv(kv_end - kv_begin, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    offsets = tl.arange(0, TILE_N)
    for tile in range(tile_lo, tile_hi):
        key_pos = kv_begin + tile * TILE_N + offsets
        key_ok = key_pos < kv_end
        page = tl.load(
            block_table_ptr + seq * stride_bt + key_pos // PAGE_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        in_page = key_pos % PAGE_SIZE
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            key_cache_ptr
            + page[:, None] * stride_kb
            + in_page[:, None] * stride_ks
            + kv_head * stride_kh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        v = tl.load(
            value_cache_ptr
            + page[:, None] * stride_vb
            + in_page[:, None] * stride_vs
            + kv_head * stride_vh
            + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)
        if IEEE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        if USE_SOFT_CAP:
            scores = soft_cap * _tanh(scores / soft_cap)
        visible = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])
        if USE_WINDOW:
            visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # Rows that have seen no visible key yet keep a finite reference point (no -inf - -inf).
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - safe_max[:, None])
        rescale = tl.exp(row_max - safe_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        if IEEE_DOT:
            acc = acc * rescale[:, None] + tl.dot(probs, v, input_precision="ieee")
        else:
            acc = acc * rescale[:, None] + tl.dot(probs, v)
        row_max = new_max

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        # Padding rows saw no key (sum 0); dividing by 1 there keeps them finite (never stored).
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]
        tl.store(
            out_ptr
            + (q_start + token)[:, None] * stride_ot
            + head[:, None] * stride_oh
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials are laid out [num_tokens, num_q_heads, NUM_SPLITS(, HEAD_PAD)], contiguous.
        num_q_heads = tl.num_programs(2) // NUM_SPLITS * GROUP
        part = ((q_start + token) * num_q_heads + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + part, row_max, mask=row_ok)
        tl.store(partial_sum_ptr + part, row_sum, mask=row_ok)
        # Padded dims hold zeros (v loads them as 0) and are written too, so the merge reads
        # only written memory.
        tl.store(
            partial_acc_ptr + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None]
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    num_seqs,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEADS_BLOCK: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Merge the splits' partial results of ``HEADS_BLOCK`` heads of one token."""
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    head_ok = heads < NUM_Q_HEADS
    splits = tl.arange(0, NUM_SPLITS)
    part = (token * NUM_Q_HEADS + heads[:, None]) * NUM_SPLITS + splits[None, :]  # [H, S]
    part_max = tl.load(partial_max_ptr + part, mask=head_ok[:, None], other=0.0)
    part_sum = tl.load(partial_sum_ptr + part, mask=head_ok[:, None], other=1.0)
    dims = tl.arange(0, HEAD_PAD)
    part_acc = tl.load(
        partial_acc_ptr + part[:, :, None] * HEAD_PAD + dims[None, None, :],
        mask=head_ok[:, None, None],
        other=0.0,
    )
    total_max = tl.max(part_max, axis=1)
    weight = tl.where(part_max == float("-inf"), 0.0, tl.exp(part_max - total_max[:, None]))
    out = tl.sum(part_acc * weight[:, :, None], axis=1) / tl.sum(part_sum * weight, axis=1)[:, None]
    tl.store(
        out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (dims[None, :] < HEAD_SIZE),
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Triton paged attention (same contract as ``ember_kernels.paged_attention``).

    ``num_kv_splits`` forces the number of KV splits (a power of two); None picks it from the
    batch: decode batches with fewer programs than the GPU has multiprocessors are split.
    """
    check_paged_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, sliding_window, out
    )
    check_head_dim_contiguous(query=query, key_cache=key_cache, value_cache=value_cache, out=out)
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    num_tokens, num_q_heads, head_size = query.shape
    page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_q_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = triton.next_power_of_2(head_size)
    # Query rows per program: the tl.dot minimum for decode; more for prefill, fewer for
    # 256-wide heads (the float32 query and accumulator tiles live in registers).
    rows_wanted = MIN_DOT_ROWS if max_query_len == 1 else (64 if head_pad <= 128 else 32)
    block_q = max(1, rows_wanted // group_pad)
    block_q = min(block_q, max(triton.next_power_of_2(max_query_len), MIN_DOT_ROWS // group_pad, 1))
    tile_n = 64 if head_pad <= 128 else 32
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    if num_kv_splits is None:
        num_kv_splits = _choose_kv_splits(
            query,
            num_seqs * num_q_tiles * num_kv_heads,
            max_query_len,
            max_seq_len,
            seq_lens,
            tile_n,
        )
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits: expected a power of two >= 1, got {num_kv_splits}")
    if num_kv_splits > 1:
        partial_acc = torch.empty(
            (num_tokens, num_q_heads, num_kv_splits, head_pad),
            dtype=torch.float32,
            device=query.device,
        )
        partial_max = torch.empty(
            (num_tokens, num_q_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_acc = partial_max = partial_sum = out  # unused by the kernel
    _paged_attention_kernel[(num_seqs, num_q_tiles, num_kv_heads * num_kv_splits)](
        out,
        partial_acc,
        partial_max,
        partial_sum,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale,
        1.0 if soft_cap is None else soft_cap,
        0 if sliding_window is None else sliding_window,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        PAGE_SIZE=page_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_kv_splits,
        USE_WINDOW=sliding_window is not None,
        USE_SOFT_CAP=soft_cap is not None,
        IEEE_DOT=query.dtype == torch.float32,
        # Four float32 tiles of BLOCK_M (or TILE_N) x HEAD_PAD live in registers.
        num_warps=8 if block_q * group_pad * head_pad >= 8192 else 4,
    )
    if num_kv_splits > 1:
        # Up to 4096 partial values per program: several heads at once, but bounded registers.
        heads_block = min(
            triton.next_power_of_2(num_q_heads), max(1, 4096 // (num_kv_splits * head_pad))
        )
        _merge_splits_kernel[(num_tokens, triton.cdiv(num_q_heads, heads_block))](
            out,
            partial_acc,
            partial_max,
            partial_sum,
            query_start_loc,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_Q_HEADS=num_q_heads,
            HEADS_BLOCK=heads_block,
            HEAD_SIZE=head_size,
            HEAD_PAD=head_pad,
            NUM_SPLITS=num_kv_splits,
        )
    return out


def _choose_kv_splits(
    query: torch.Tensor,
    num_programs: int,
    max_query_len: int,
    max_seq_len: int | None,
    seq_lens: torch.Tensor,
    tile_n: int,
) -> int:
    """Split decode batches whose programs would leave multiprocessors idle; at most 16 splits,
    and at least two KV tiles per split."""
    if max_query_len != 1 or not query.is_cuda:
        return 1
    sm_count = _multiprocessor_count(query.device)
    if num_programs >= sm_count:
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    splits = 1
    while (
        splits < 16
        and num_programs * splits < 2 * sm_count
        and max_seq_len >= 2 * splits * 2 * tile_n
    ):
        splits *= 2
    return splits


@functools.cache
def _multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
