"""What one layer keeps per request, and how layers with the same need are grouped.

A spec answers two questions for its layers: which of a request's earlier tokens can a new query
still see (the rest of their KV can be freed), and how many blocks one step of a request needs at
most (so that a pool can promise to serve any length). Layers with equal specs share one block
table (a group); every group allocates from the same block pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    """Every token's KV stays readable for the whole request."""

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV no query from ``num_computed_tokens`` on reads: none."""
        return 0

    def max_blocks_per_step(self, block_size: int, max_new_tokens: int) -> int | None:
        """Blocks a request holds at most in one step at any length: unbounded (None)."""
        return None


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A query sees itself and the ``window - 1`` tokens before it (Mistral, Gemma's local
    layers)."""

    window: int

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"SlidingWindowSpec.window must be an int >= 1, got {self.window!r}")

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # The next query sits at position num_computed_tokens and sees back to window - 1 before.
        return max(0, num_computed_tokens - self.window + 1)

    def max_blocks_per_step(self, block_size: int, max_new_tokens: int) -> int | None:
        # The window's tokens before the step plus the step's own, unaligned: one block more.
        return -(-(self.window - 1 + max_new_tokens) // block_size) + 1


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec:
    """A query sees the tokens of its own chunk up to itself (chunks of ``chunk_size``
    positions from 0; Llama 4's local layers)."""

    chunk_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise ValueError(
                f"ChunkedLocalAttentionSpec.chunk_size must be an int >= 1, got {self.chunk_size!r}"
            )

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.chunk_size * self.chunk_size

    def max_blocks_per_step(self, block_size: int, max_new_tokens: int) -> int | None:
        return -(-(self.chunk_size - 1 + max_new_tokens) // block_size) + 1


@dataclass(frozen=True)
class StateSpec:
    """One fixed-size state per request, whatever its length (Mamba's conv and SSM state,
    linear attention): one block per request."""

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens

    def max_blocks_per_step(self, block_size: int, max_new_tokens: int) -> int | None:
        return 1


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | StateSpec
SPEC_TYPES = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, StateSpec)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table: their common spec and their indices, in order."""

    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


def group_layers(layer_specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers by spec, groups in the order of their first layer (so a model with one
    kind of layer has one group, number 0)."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(layer_specs):
        if not isinstance(spec, SPEC_TYPES):
            raise ValueError(f"layer_specs[{index}] is not a KV cache spec: {spec!r}")
        groups.setdefault(spec, []).append(index)
    if not groups:
        raise ValueError("layer_specs must name at least one layer")
    return [KVCacheGroup(spec, tuple(ids)) for spec, ids in groups.items()]


def group_layers_evenly(layer_specs: Sequence[KVCacheSpec]) -> list[KVCacheGroup]:
    """``group_layers`` with groups of one size where it can: each spec's layers split into runs
    of the smallest group's size. An engine whose layer ``j`` of every group shares one cache
    tensor (a block id means the same place in each) then spends a block on as many layers as a
    group has, whichever group holds it: Gemma 3's 5 local layers per global one make 5 local
    groups beside the global one, not one group five times its size."""
    groups = group_layers(layer_specs)
    token_groups = [group for group in groups if not isinstance(group.spec, StateSpec)]
    if not token_groups:
        return groups
    size = min(len(group.layer_ids) for group in token_groups)
    return [
        KVCacheGroup(group.spec, group.layer_ids[start : start + step])
        for group in groups
        # A state group stays whole: its one block per request holds every state layer's state.
        for step in [len(group.layer_ids) if isinstance(group.spec, StateSpec) else size]
        for start in range(0, len(group.layer_ids), step)
    ]


def max_tokens_per_request(
    specs: Sequence[KVCacheSpec], num_blocks: int, block_size: int, max_new_tokens: int
) -> int | None:
    """The longest request a pool of ``num_blocks`` usable blocks can always serve alone when a
    step adds at most ``max_new_tokens`` tokens: None (any length) when every group's need per
    step is bounded and they fit together; else the most whole blocks of tokens ``k`` for which
    ``k`` blocks in each unbounded group plus ``min(k, need)`` in each bounded one fit (a group
    never holds more than one block per block of tokens)."""
    needs = [spec.max_blocks_per_step(block_size, max_new_tokens) for spec in specs]
    bounded = [need for need in needs if need is not None]
    if len(bounded) == len(needs) and sum(bounded) <= num_blocks:
        return None
    unbounded = len(needs) - len(bounded)

    def blocks_for(k: int) -> int:
        return unbounded * k + sum(min(k, need) for need in bounded)

    low, high = 0, num_blocks  # blocks_for(k) >= k: no k above num_blocks fits
    while low < high:
        middle = (low + high + 1) // 2
        if blocks_for(middle) <= num_blocks:
            low = middle
        else:
            high = middle - 1
    return low * block_size
