"""KV bookkeeping for a model that interleaves sliding-window and global layers (Gemma-style).

Layers 0, 1, 3, 4 see a window of 16 tokens, layers 2 and 5 every token. The two groups keep a
block table each over one pool; the window group's table holds the null block (0) where its
tokens left the window, so its memory stays flat however long the sequence grows. Each group's
layers store KV in a numpy array indexed by that group's block ids.
"""

import numpy as np

from ember_kv_cache import FullAttentionSpec, HybridKVCacheManager, SlidingWindowSpec, group_layers

BLOCK_SIZE, NUM_BLOCKS, HEAD_DIM = 4, 64, 8
local, full = SlidingWindowSpec(16), FullAttentionSpec()
groups = group_layers([local, local, full, local, local, full])
mgr = HybridKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, [g.spec for g in groups])
# One array per layer, [blocks, slots, dim]: a block id means the same place in each of them.
kv_store = np.zeros((6, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM), dtype=np.float32)


def write_kv(request_id, token_ids, start):
    pos = np.arange(start, len(token_ids))
    for group, table in zip(groups, mgr.get_block_ids(request_id)):
        table = np.asarray(table)
        for layer in group.layer_ids:
            kv_store[layer, table[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = pos[:, None] + layer


tokens = list(range(10))
mgr.allocate_slots("req-0", tokens, len(tokens))
write_kv("req-0", tokens, 0)
for step in range(70):
    tokens.append(step)
    if mgr.allocate_slots("req-0", tokens, 1, num_computed_tokens=len(tokens) - 1) is None:
        raise RuntimeError("out of blocks")
    write_kv("req-0", tokens, len(tokens) - 1)
    if len(tokens) % 20 == 0:
        local_table, full_table = mgr.get_block_ids("req-0")
        held = sum(1 for block in local_table if block)
        print(f"{len(tokens)} tokens: window group holds {held} blocks, global {len(full_table)}")
# The global layers still read the first token; the window layers only the last 16.
full_table = mgr.get_block_ids("req-0")[1]
assert kv_store[2, full_table[0], 0, 0] == 2.0
mgr.free("req-0")
print(f"all blocks free again: {mgr.usage == 0.0}")
