"""The public kernel functions: each dispatches on its tensors' device.

CUDA tensors run the Triton kernels (``ember_kernels.triton_ops``, imported on first use so that
CPU-only users never import triton); CPU tensors of the dtypes the compiled C++ kernels take
(``ember_kernels.cpu_ops``) run those where they could be built; other tensors run the
vectorized torch paths (``ember_kernels.torch_ops``).
"""

from __future__ import annotations

import torch

from ember_kernels import cpu_ops, torch_ops


def _backend(t: torch.Tensor):
    if t.is_cuda:
        from ember_kernels import triton_ops

        return triton_ops
    if t.device.type == "cpu" and t.dtype in cpu_ops.DTYPES and cpu_ops.available():
        return cpu_ops
    return torch_ops


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value [num_tokens, num_kv_heads, head_size]`` into the paged caches
    ``[num_blocks, block_size, num_kv_heads, head_size]`` at ``slot_mapping [num_tokens]``
    (``slot = block_id * block_size + offset``; a negative slot skips the token)."""
    _check_cache_args(key, value, key_cache, value_cache, slot_mapping)
    _backend(key).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


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
) -> torch.Tensor:
    """Causal paged attention for a batch mixing prefill, chunked prefill and decode.

    ``query [num_tokens, num_q_heads, head_size]`` holds every sequence's new tokens back to back;
    sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``, which are its last
    ``q_len`` positions out of ``seq_lens[i]`` (KV length including them; their KV is already in
    the cache). ``block_table [num_seqs, max_blocks]`` lists each sequence's physical blocks in
    order. ``num_q_heads`` must be a multiple of ``num_kv_heads`` (grouped-query attention).
    ``sliding_window`` lets a query see itself and the ``sliding_window - 1`` keys before it;
    ``soft_cap`` applies ``soft_cap * tanh(score / soft_cap)`` to the scaled scores.
    ``max_query_len`` / ``max_seq_len`` are host-side upper bounds that spare the GPU path a
    device sync. Returns ``out`` (allocated when None) ``[num_tokens, num_q_heads, head_size]``.
    """
    return _backend(query).paged_attention(
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        scale=scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        out=out,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim with float32 statistics: ``weight * (x / rms(x)).to(x.dtype)``."""
    _check_norm_args(x, weight)
    return _backend(x).rms_norm(x, weight, eps, out=out)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)`` as new tensors (inputs unchanged)."""
    _check_norm_args(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual: expected shape {tuple(x.shape)} and dtype {x.dtype}, got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    return _backend(x).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2*d]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"x: last dim must be even (gate and up halves), got {x.shape[-1]}")
    return _backend(x).silu_and_mul(x, out=out)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary embedding from a ``[max_position, rotary_dim]`` cos|sin cache (see RotaryEmbedding)."""
    return _backend(query).rotary_embedding(positions, query, key, cos_sin_cache, is_neox_style)


def _check_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(
            f"key/value: expected equal shapes [num_tokens, num_kv_heads, head_size], got "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            "key_cache/value_cache: expected equal shapes [num_blocks, block_size, num_kv_heads,"
            f" head_size], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(
            f"key_cache: [num_kv_heads, head_size] {tuple(key_cache.shape[2:])} differs from "
            f"key's {tuple(key.shape[1:])}"
        )
    if key_cache.dtype != key.dtype or value_cache.dtype != value.dtype:
        raise ValueError(
            f"key_cache/value_cache: dtypes {key_cache.dtype}/{value_cache.dtype} differ from "
            f"key/value's {key.dtype}/{value.dtype}"
        )
    if slot_mapping.shape != (key.shape[0],) or slot_mapping.dtype not in (
        torch.int32,
        torch.int64,
    ):
        raise ValueError(
            f"slot_mapping: expected an integer tensor [num_tokens={key.shape[0]}], got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight: expected [{x.shape[-1]}], got {tuple(weight.shape)}")
