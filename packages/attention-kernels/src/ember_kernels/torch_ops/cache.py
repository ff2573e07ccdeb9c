"""Writing new keys and values into the paged KV cache, in torch."""

from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value [num_tokens, kv_heads, head]`` to the slots in ``slot_mapping``.

    A slot is ``block_id * block_size + offset``; a negative slot skips its token (padding).
    """
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slot_mapping.numel() and int(slot_mapping.max()) >= num_slots:
        raise ValueError(f"slot_mapping: slot {int(slot_mapping.max())} >= {num_slots} cache slots")
    valid = slot_mapping >= 0
    if bool(valid.all()):
        slots, new_keys, new_values = slot_mapping, key, value
    else:
        slots, new_keys, new_values = slot_mapping[valid], key[valid], value[valid]
    # One row copy per token into the caches viewed as [slots, kv_heads, head].
    slots = slots.long()
    key_cache.view(num_slots, *key_cache.shape[2:]).index_copy_(0, slots, new_keys)
    value_cache.view(num_slots, *value_cache.shape[2:]).index_copy_(0, slots, new_values)
