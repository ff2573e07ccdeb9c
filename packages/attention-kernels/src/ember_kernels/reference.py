"""Plain, loop-per-sequence torch references of every kernel.

They compute in the dtype of their inputs (the tests pass float64 copies) and favour clarity over
speed: the tests check both the CPU paths and the Triton kernels against them, and the CPU
benchmark uses ``paged_attention_reference`` as its naive baseline.
"""

from __future__ import annotations

import math

import torch


def paged_attention_reference(
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
) -> torch.Tensor:
    """Attention of each sequence's new queries (its last ``q_len`` positions) over its pages."""
    out = torch.zeros_like(query)
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for seq, seq_len in enumerate(seq_lens.tolist()):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        if end == start:
            continue
        num_pages = math.ceil(seq_len / block_size)
        pages = block_table[seq, :num_pages].long()
        keys = key_cache[pages].flatten(0, 1)[:seq_len].permute(1, 0, 2)  # [kv_heads, seq, head]
        values = value_cache[pages].flatten(0, 1)[:seq_len].permute(1, 0, 2)
        q_len = end - start
        # [q_len, q_heads, head] -> [kv_heads, group * q_len, head]: the heads sharing a KV head.
        q = query[start:end].unflatten(1, (num_kv_heads, group)).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * q_len, -1)
        scores = torch.matmul(q, keys.transpose(1, 2)) * scale  # [kv_heads, group * q_len, seq]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        query_pos = torch.arange(seq_len - q_len, seq_len).repeat(group)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), values)  # [kv_heads, group * q_len, head]
        out[start:end] = o.view(num_kv_heads, group, q_len, -1).permute(2, 0, 1, 3).flatten(1, 2)
    return out


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token ``i``'s key and value to slot ``slot_mapping[i]``, skipping negative slots."""
    block_size = key_cache.shape[1]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            key_cache[slot // block_size, slot % block_size] = key[token]
            value_cache[slot // block_size, slot % block_size] = value[token]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def rope_inv_freq_reference(
    rotary_dim: int, base: float, rope_scaling: dict | None = None
) -> list[float]:
    """Inverse frequencies of every rotated pair, in Python floats, per the rope-scaling formulas."""
    inv_freq = [1.0 / base ** (2 * i / rotary_dim) for i in range(rotary_dim // 2)]
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "linear":
        return [f / rope_scaling["factor"] for f in inv_freq]
    if rope_type != "llama3":
        return inv_freq
    factor = rope_scaling["factor"]
    low, high = rope_scaling["low_freq_factor"], rope_scaling["high_freq_factor"]
    old_context = rope_scaling["original_max_position_embeddings"]
    scaled = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old_context / high:
            scaled.append(f)
        elif wavelen > old_context / low:
            scaled.append(f / factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * f / factor + smooth * f)
    return scaled


def rotary_embedding_reference(
    positions: torch.Tensor,
    x: torch.Tensor,
    inv_freq: list[float],
    is_neox_style: bool,
) -> torch.Tensor:
    """Rotate pairs of ``x [tokens, heads, head]`` by ``position * inv_freq`` (NeoX or GPT-J)."""
    rotary_dim = 2 * len(inv_freq)
    angles = positions.to(x.dtype)[:, None] * torch.tensor(inv_freq, dtype=x.dtype)[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    out = x.clone()
    if is_neox_style:
        first, second = slice(0, rotary_dim // 2), slice(rotary_dim // 2, rotary_dim)
    else:
        first, second = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    out[..., first] = x[..., first] * cos - x[..., second] * sin
    out[..., second] = x[..., second] * cos + x[..., first] * sin
    return out


def lora_reference(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    slot_indices: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """The LoRA delta of every row, one row at a time: ``scale * B[slot] A[slot] x`` (zeros for
    slot ``-1``); ``lora_a [slots, rank, in]``, ``lora_b [slots, out, rank]``."""
    out = x.new_zeros(x.shape[0], lora_b.shape[1])
    for row, slot in enumerate(slot_indices.tolist()):
        if slot >= 0:
            out[row] = scale * (lora_b[slot] @ (lora_a[slot] @ x[row]))
    return out
