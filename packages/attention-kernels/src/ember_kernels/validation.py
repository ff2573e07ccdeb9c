"""Argument checks shared by the torch and Triton paths (shapes, dtypes, strides: no device sync)."""

from __future__ import annotations

import torch


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    out: torch.Tensor | None,
) -> None:
    if query.dim() != 3:
        raise ValueError(
            f"query: expected [num_tokens, num_q_heads, head_size], got {tuple(query.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache/value_cache: expected equal shapes [num_blocks, block_size, num_kv_heads,"
            f" head_size], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_q_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size:
        raise ValueError(f"key_cache: head_size {key_cache.shape[3]} != query's {head_size}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"query: num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if key_cache.dtype != query.dtype or value_cache.dtype != query.dtype:
        raise ValueError(
            f"key_cache/value_cache: dtype {key_cache.dtype} differs from query's {query.dtype}"
        )
    num_seqs = seq_lens.shape[0]
    if seq_lens.dim() != 1 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc: expected [num_seqs + 1] = [{num_seqs + 1}], got "
            f"{tuple(query_start_loc.shape)}"
        )
    if block_table.dim() != 2 or block_table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table: expected [num_seqs={num_seqs}, max_blocks], got {tuple(block_table.shape)}"
        )
    for name, t in (
        ("block_table", block_table),
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
    ):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected an integer tensor, got {t.dtype}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window: expected None or >= 1, got {sliding_window}")
    if out is not None and (out.shape != query.shape or out.dtype != query.dtype):
        raise ValueError(
            f"out: expected shape {tuple(query.shape)} and dtype {query.dtype}, got "
            f"{tuple(out.shape)} {out.dtype}"
        )


def check_head_dim_contiguous(**tensors: torch.Tensor | None) -> None:
    """The Triton kernels address the head_size (last) dim with stride 1; None entries are skipped."""
    for name, t in tensors.items():
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name}: the head_size dim must be contiguous (stride 1)")
