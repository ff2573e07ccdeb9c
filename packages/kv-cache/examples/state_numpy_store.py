"""KV bookkeeping for an attention / state-space hybrid (Mamba-style layers beside attention).

Layers 0, 1 and 3 keep a fixed-size state per request (here a toy recurrence: a running sum of
the token ids, as a Mamba layer keeps its conv window and SSM state); layer 2 is full attention.
The state group holds one block per request however long it grows, the attention group one per
``BLOCK_SIZE`` tokens, both from one pool. Prefix caching is off for such a model (a cached
block cannot restore a state), and a preempted request rebuilds its state by recomputing.
"""

import numpy as np

from ember_kv_cache import FullAttentionSpec, HybridKVCacheManager, StateSpec, group_layers

BLOCK_SIZE, NUM_BLOCKS = 4, 32
groups = group_layers([StateSpec(), StateSpec(), FullAttentionSpec(), StateSpec()])
mgr = HybridKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, [g.spec for g in groups], enable_caching=False)
states = np.zeros((4, NUM_BLOCKS), dtype=np.int64)  # [layer, state block]: the running sum
kv_store = np.zeros((4, NUM_BLOCKS, BLOCK_SIZE), dtype=np.int64)  # [layer, block, slot]


def step(request_id, token_ids, start, fresh=False):
    """Feed ``token_ids[start:]``: the state layers update their one block, attention writes KV."""
    (state_block,), kv_table = mgr.get_block_ids(request_id)
    new = np.asarray(token_ids[start:])
    pos = np.arange(start, len(token_ids))
    for layer in groups[0].layer_ids:
        states[layer, state_block] = (0 if fresh else states[layer, state_block]) + new.sum()
    kv_store[2, np.asarray(kv_table)[pos // BLOCK_SIZE], pos % BLOCK_SIZE] = new


tokens = list(range(1, 11))
mgr.allocate_slots("req-0", tokens, len(tokens))
step("req-0", tokens, 0, fresh=True)
for token in range(11, 41):
    tokens.append(token)
    mgr.allocate_slots("req-0", tokens, 1, num_computed_tokens=len(tokens) - 1)
    step("req-0", tokens, len(tokens) - 1)
(state_block,), kv_table = mgr.get_block_ids("req-0")
print(f"{len(tokens)} tokens: state group holds 1 block, attention {len(kv_table)}")
assert states[0, state_block] == sum(tokens)
# Preempted: every block goes back to the pool; on resume the prompt and outputs are recomputed.
mgr.free("req-0")
mgr.allocate_slots("req-0", tokens, len(tokens))
step("req-0", tokens, 0, fresh=True)
(state_block,), _ = mgr.get_block_ids("req-0")
print(f"state after recompute equals the running one: {states[3, state_block] == sum(tokens)}")
mgr.free("req-0")
print(f"all blocks free again: {mgr.usage == 0.0}")
