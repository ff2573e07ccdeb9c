"""Random engine runs over window and hybrid managers, with a simulated KV store.

Each step admits requests (with prefix-cache lookups), runs chunked prefill and decode, frees
finished or preempted ones; the store records which request's token each slot holds. After
every allocation, every position the step's queries see must hold KV of that request's own
token at that position: a block handed out while still needed, or a wrong prefix hit, fails this.
"""

import random

import pytest

from ember_kv_cache import (
    FullAttentionSpec,
    HybridKVCacheManager,
    LocalAttentionManager,
    SlidingWindowSpec,
)

BLOCK = 4
NUM_BLOCKS = 40


def tables_of(mgr, request_id):
    tables = mgr.get_block_ids(request_id)
    return [tables] if isinstance(mgr, LocalAttentionManager) else list(tables)


def run_engine(mgr, specs, seed):
    rng = random.Random(seed)
    store = {}  # (group, block id, slot) -> (token id, position)
    # A few shared prompt heads, so that lookups hit.
    heads = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    running = {}  # request id -> [tokens, num computed]
    waiting = []
    next_id = 0
    for _ in range(300):
        if rng.random() < 0.3 and len(waiting) + len(running) < 6:
            head = rng.choice(heads)
            waiting.append(
                (f"r{next_id}", head + [rng.randrange(50) for _ in range(rng.randrange(1, 12))])
            )
            next_id += 1
        if waiting and rng.random() < 0.6:
            request_id, tokens = waiting.pop(0)
            hit = mgr.get_computed_blocks(request_id, tokens)
            num_new = min(len(tokens) - hit.num_computed_tokens, rng.choice([3, 8, 100]))
            if mgr.allocate_slots(request_id, tokens, num_new, computed=hit) is None:
                waiting.insert(0, (request_id, tokens))
            else:
                write(mgr, store, request_id, tokens, hit.num_computed_tokens, num_new)
                check_visible(mgr, specs, store, request_id, tokens, hit.num_computed_tokens)
                running[request_id] = [tokens, hit.num_computed_tokens + num_new]
        for request_id in list(running):
            tokens, computed = running[request_id]
            if computed == len(tokens):
                tokens.append(rng.randrange(50))  # the sampled token
            num_new = min(len(tokens) - computed, rng.choice([1, 1, 5]))
            if (
                mgr.allocate_slots(request_id, tokens, num_new, num_computed_tokens=computed)
                is None
            ):
                mgr.free(request_id)  # preempted: recomputed from the start later
                del running[request_id]
                waiting.append((request_id + "p", tokens))
                continue
            write(mgr, store, request_id, tokens, computed, num_new)
            check_visible(mgr, specs, store, request_id, tokens, computed, num_new)
            running[request_id][1] = computed + num_new
            if computed + num_new > 60 or rng.random() < 0.03:
                mgr.free(request_id)
                del running[request_id]
    for request_id in running:
        mgr.free(request_id)
    assert mgr.usage == 0.0


def write(mgr, store, request_id, tokens, start, num_new):
    for group, table in enumerate(tables_of(mgr, request_id)):
        for position in range(start, start + num_new):
            store[group, table[position // BLOCK], position % BLOCK] = (tokens[position], position)


def check_visible(mgr, specs, store, request_id, tokens, start, num_new=0):
    """What this step's queries (positions ``start`` on) read: the window before the first."""
    for group, (spec, table) in enumerate(zip(specs, tables_of(mgr, request_id))):
        first = max(0, start - spec.window + 1) if isinstance(spec, SlidingWindowSpec) else 0
        for position in range(first, start + num_new):
            block = table[position // BLOCK]
            assert block != 0, (request_id, group, position)
            held = store.get((group, block, position % BLOCK))
            assert held == (tokens[position], position), (request_id, group, position)


@pytest.mark.parametrize("seed", range(6))
def test_window_manager_never_loses_visible_kv(seed):
    spec = SlidingWindowSpec(7)
    run_engine(LocalAttentionManager(NUM_BLOCKS, BLOCK, spec), [spec], seed)


@pytest.mark.parametrize("seed", range(6))
def test_hybrid_manager_never_loses_visible_kv(seed):
    specs = [SlidingWindowSpec(6), FullAttentionSpec(), SlidingWindowSpec(6)]
    run_engine(HybridKVCacheManager(NUM_BLOCKS, BLOCK, specs), specs, seed)
