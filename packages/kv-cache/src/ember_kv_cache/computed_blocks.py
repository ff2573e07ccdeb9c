"""The result of a prefix-cache lookup, and the check that it still holds when it is used."""

from __future__ import annotations

from dataclasses import dataclass, field

from ember_kv_cache.block import KVCacheBlock, PartialBlock
from ember_kv_cache.hashing import BlockHashExtras


@dataclass(frozen=True)
class ComputedBlocks:
    """The longest cached prefix found for a request: whole blocks whose KV is already stored,
    and (with ``reuse_partial_blocks``) the start of the next block, whose KV a free block holds
    and the request's new block gets by copy.

    Hand it to ``KVCacheManager.allocate_slots`` (as ``computed``) right after the lookup; the
    manager refuses it with a ValueError if one of its blocks was evicted in between.
    """

    block_ids: list[int]
    num_computed_tokens: int  # whole blocks' tokens plus num_partial_tokens
    blocks: tuple[KVCacheBlock, ...] = field(default=(), repr=False)
    block_hashes: tuple[bytes, ...] = field(default=(), repr=False)
    extras: BlockHashExtras | None = field(default=None, repr=False)
    partial_block: KVCacheBlock | None = field(default=None, repr=False)
    num_partial_tokens: int = 0
    # What partial_block held at the lookup (its token index entry).
    partial_state: PartialBlock | None = field(default=None, repr=False)

    def check(self, block_size: int, extras: BlockHashExtras | None) -> None:
        """Refuse (ValueError) a value not returned by ``get_computed_blocks`` for these
        ``extras``, or one whose blocks were evicted or handed out since the lookup."""
        num_partial = self.num_partial_tokens
        if (
            len(self.blocks) != len(self.block_hashes)
            or len(self.blocks) != len(self.block_ids)
            or self.num_computed_tokens != len(self.blocks) * block_size + num_partial
            or not 0 <= num_partial < block_size
            or (num_partial > 0) != (self.partial_block is not None)
        ):
            raise ValueError("computed is not a ComputedBlocks returned by get_computed_blocks")
        if self.extras != extras:
            raise ValueError("extras differ from the extras of the get_computed_blocks lookup")
        for block, block_hash in zip(self.blocks, self.block_hashes):
            if block.block_hash != block_hash and not block.is_null:
                raise ValueError(
                    f"computed blocks are stale: block {block.block_id} was evicted since "
                    "get_computed_blocks; look the prefix up again"
                )
        partial = self.partial_block
        # Identity, not equality: a block handed out and filled again with the same tokens gets a
        # new entry, and its KV may be unwritten yet.
        if partial is not None and partial.partial is not self.partial_state:
            raise ValueError(
                f"computed blocks are stale: block {partial.block_id} was handed out since "
                "get_computed_blocks; look the prefix up again"
            )
