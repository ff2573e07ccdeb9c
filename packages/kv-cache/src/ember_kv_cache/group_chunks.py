"""KV chunks of a model with several layer groups (or one sliding-window group) in the tiers.

Each group stores its own entry per chunk, under the chunk's chain hash tagged with the group
(``group_chunk_hash``: group 0 keeps the plain hash, so a full-attention model's keys stay what
they were). A local group stores the blocks it still holds when the chunk is saved, a tail of
the chunk (the blocks before it already left the window). A hit may end at ``end_block`` when
every group holds what its next query reads (``group_hit_holds``): a full group every block
past the local prefix hit, a local group only its window's tail. The scheduler asks that of the
chunks its tiers contain, the worker again of the blocks it actually read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ember_kv_cache.specs import FullAttentionSpec, KVCacheSpec, StateSpec


def group_chunk_hash(chunk_hash: bytes, group: int) -> bytes:
    """The key of group ``group``'s entry of a chunk: the chunk's hash, tagged past group 0."""
    if not isinstance(group, int) or group < 0:
        raise ValueError(f"group must be an int >= 0, got {group!r}")
    return chunk_hash if group == 0 else chunk_hash + b"/group/" + str(group).encode()


def check_connector_specs(specs: Sequence[KVCacheSpec]) -> tuple[KVCacheSpec, ...]:
    """``specs`` (one per group) if a KV connector can serve them; a state group (Mamba) is
    refused by name, since a stored chunk cannot restore a state that summarizes every token."""
    specs = tuple(specs) or (FullAttentionSpec(),)
    if any(isinstance(spec, StateSpec) for spec in specs):
        raise ValueError(
            "kv_transfer_config: the KV connector cannot serve a model with state layers "
            "(Mamba / linear attention): a stored chunk cannot restore their state"
        )
    return specs


def describe_groups(specs: Sequence[KVCacheSpec]) -> str:
    """The groups' specs as the layout fingerprint names them ("" for one full group, the
    layout every engine had before groups)."""
    specs = tuple(specs)
    if specs == (FullAttentionSpec(),):
        return ""
    return "|".join(repr(spec) for spec in specs)


def group_hit_holds(
    specs: Sequence[KVCacheSpec],
    block_size: int,
    held: Sequence[np.ndarray],
    num_local_blocks: int,
    end_block: int,
) -> bool:
    """Whether a prefix of ``end_block`` blocks can be continued from: for each group, every
    block its next query reads past the ``num_local_blocks`` of the local hit is in ``held``
    (that group's flag per block)."""
    if end_block <= num_local_blocks:
        return False
    for spec, flags in zip(specs, held, strict=True):
        first = spec.num_skipped_tokens(end_block * block_size) // block_size
        start = max(num_local_blocks, first)
        if len(flags) < end_block or not flags[start:end_block].all():
            return False
    return True
