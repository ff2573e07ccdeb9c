"""What each layer of a model keeps in the KV cache, as ``ember_kv_cache`` specs: the scheduler's
KV cache manager groups layers by them, and so does the worker (``kv_cache_groups``).

With several groups (Gemma's local and global layers) each group has its own block table; the
scheduler interleaves them into one row per request (group ``g``'s blocks are the row's entries
``g::num_groups``), and layer ``j`` of every group shares cache tensor ``j``: a block id means
the same place in each, whichever group holds it."""

from __future__ import annotations

import torch

from ember_kv_cache import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    StateSpec,
    group_layers_evenly,
)
from ember_kv_cache.specs import KVCacheSpec
from ember_worker.hf_config import load_hf_config, resolve_model_path
from ember_worker.models import DecoderConfig


def layer_kv_specs(config: DecoderConfig) -> list[KVCacheSpec]:
    """One spec per layer: a state for a Mamba layer (``MambaHybridConfig.mamba_layers``), a
    sliding window where the layer has one, else full attention."""
    mamba = getattr(config, "mamba_layers", None) or (False,) * config.num_hidden_layers
    return [
        StateSpec()
        if is_mamba
        else FullAttentionSpec()
        if window is None
        else SlidingWindowSpec(int(window))
        for window, is_mamba in zip(config.sliding_windows, mamba)
    ]


def model_layer_kv_specs(model: str) -> list[KVCacheSpec]:
    """``layer_kv_specs`` of a model folder's config (for executors that load no weights)."""
    return layer_kv_specs(DecoderConfig.from_hf_config(load_hf_config(resolve_model_path(model))))


def kv_cache_groups(config: DecoderConfig) -> list[KVCacheGroup]:
    """The token-block layer groups of a model (those with paged KV), as the scheduler's KV
    cache manager forms them; its state groups (``state_groups``) lead each block-table row."""
    groups = group_layers_evenly(layer_kv_specs(config))
    return [group for group in groups if not isinstance(group.spec, StateSpec)]


def state_groups(config: DecoderConfig) -> list[KVCacheGroup]:
    """The model's state groups (Mamba layers): one block per request each."""
    groups = group_layers_evenly(layer_kv_specs(config))
    return [group for group in groups if isinstance(group.spec, StateSpec)]


def layer_caches(
    caches: list[tuple[torch.Tensor, torch.Tensor]], groups: list[KVCacheGroup]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[int]]:
    """Each layer's (key, value) cache, layer ``j`` of a group on tensor pair ``j``, and its
    group's index."""
    num_layers = sum(len(group.layer_ids) for group in groups)
    per_layer: list = [None] * num_layers
    group_of = [0] * num_layers
    for index, group in enumerate(groups):
        for position, layer in enumerate(group.layer_ids):
            per_layer[layer] = caches[position]
            group_of[layer] = index
    return per_layer, group_of
