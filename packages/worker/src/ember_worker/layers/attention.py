"""Paged attention layer: writes this step's keys/values into the KV cache, then attends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

import ember_kernels as ek


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache and which pages each sequence reads.

    Shared by every layer of one forward pass; built by the model runner from ``ModelInputs``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, KV length including this step's tokens
    max_query_len: int
    max_seq_len: int
    # With a KV connector: its worker side, whose per-layer waits and saves each layer calls.
    kv_connector: KVLayerTransfer | None = None
    # With several KV groups: (slot_mapping, block_table) of each; a layer reads its group's.
    group_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    # A Mamba hybrid's: [num_seqs, num_state_groups] each row's state slot (its slot in the
    # mixers' state tensors; ember_worker.mamba_state).
    state_slots: torch.Tensor | None = None


class KVLayerTransfer(Protocol):
    """What attention layers call on a KV connector during a forward (by layer index)."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def save_kv_layer(self, layer: int) -> None: ...


class PagedAttention(nn.Module):
    """Causal multi-head (grouped-query) attention over a paged KV cache.

    ``kv_cache`` is bound after the cache tensors are allocated (``bind_kv_cache``): a pair of
    ``[num_blocks, block_size, num_kv_heads, head_size]`` tensors.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap  # tanh soft-capping of the scaled scores (Gemma 2)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.layer_index = 0  # this layer's place among the bound caches
        self.kv_group = 0  # its KV group (ember_worker.kv_specs), with several

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """``q`` [num_tokens, num_heads * head_size], ``k``/``v`` [num_tokens, num_kv_heads * head_size]."""
        if self.kv_cache is None:
            raise RuntimeError("PagedAttention has no KV cache bound; call bind_kv_cache first")
        key_cache, value_cache = self.kv_cache
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_size)
        k = k.view(num_tokens, self.num_kv_heads, self.head_size)
        v = v.view(num_tokens, self.num_kv_heads, self.head_size)
        slot_mapping, block_table = metadata.slot_mapping, metadata.block_table
        if metadata.group_tables is not None:
            slot_mapping, block_table = metadata.group_tables[self.kv_group]
        connector = metadata.kv_connector
        if connector is None:
            ek.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
        else:
            connector.wait_for_layer_load(self.layer_index)
            ek.reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
            connector.save_kv_layer(self.layer_index)
        out = ek.paged_attention(
            q,
            key_cache,
            value_cache,
            block_table,
            metadata.query_start_loc,
            metadata.seq_lens,
            scale=self.scale,
            sliding_window=self.sliding_window,
            soft_cap=self.soft_cap,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
        )
        return out.view(num_tokens, self.num_heads * self.head_size)


def bind_kv_cache(
    model: nn.Module,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    kv_groups: list[int] | None = None,
) -> None:
    """Give each attention layer of ``model``, in order, its (key, value) cache tensors (and,
    with several KV groups, its group's index)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if len(layers) != len(kv_caches):
        raise ValueError(f"model has {len(layers)} attention layers, got {len(kv_caches)} caches")
    for index, (layer, cache) in enumerate(zip(layers, kv_caches)):
        layer.kv_cache = cache
        layer.layer_index = index
        layer.kv_group = kv_groups[index] if kv_groups is not None else 0
