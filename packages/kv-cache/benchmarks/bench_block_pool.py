"""Allocation + free throughput of the block pool at 1k, 10k and 100k blocks.

Baseline, measured in the same run: nano-vllm's block manager (``nano_vllm_baseline.py``): a
deque free list (``popleft`` to allocate, ``deque.remove`` to take a cached block back on a prefix
hit) and incremental chained xxh64 hashes. Each operation allocates
4 new blocks, takes back 2 cached free blocks (prefix hits) and frees all 6, with half the pool
holding cached free blocks. Prints operations per second and the speed-up.

Run: python3 benchmarks/bench_block_pool.py
"""

from __future__ import annotations

import random
import time

from nano_vllm_baseline import DequeFreeListPool, NanoVLLMBlockManager

from ember_kv_cache import BlockPool, KVCacheManager

NEW_PER_OP, HITS_PER_OP = 4, 2


def _ops_per_second(pool, hit_sets, new, seconds: float) -> float:
    ops, start = 0, time.perf_counter()
    while True:
        for hits in hit_sets:
            blocks = new(NEW_PER_OP)
            pool.touch(hits)
            pool.free_blocks([*hits, *blocks][::-1])
        ops += len(hit_sets)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return ops / elapsed


def bench_pools(num_blocks: int, seconds: float) -> tuple[float, float]:
    """(ember ops/s, deque-based ops/s) with the second half of the pool cached and free."""
    rng = random.Random(0)
    pool = BlockPool(num_blocks)
    baseline = DequeFreeListPool(num_blocks)
    cached = list(range(num_blocks // 2, num_blocks))
    for block_id in cached:
        pool.cache_full_block(pool.blocks[block_id], block_id.to_bytes(4, "little"), None, (), ())
    hit_sets = [rng.sample(cached, HITS_PER_OP) for _ in range(64)]
    ours = _ops_per_second(
        pool, [[pool.blocks[b] for b in hs] for hs in hit_sets], pool.get_new_blocks, seconds
    )
    theirs = _ops_per_second(baseline, hit_sets, baseline.get_new_blocks, seconds)
    return ours, theirs


def bench_decode(mgr, num_blocks: int, seconds: float) -> float:
    """allocate_slots calls per second: rounds of requests with a 100-token prompt that each
    decode 64 tokens (a new block every 16 tokens) and are freed."""
    num_requests = min(1000, num_blocks // 12)
    calls, start = 0, time.perf_counter()
    round_index = 0
    while time.perf_counter() - start < seconds:
        requests = {f"r{round_index}-{i}": [i % 97] * 100 for i in range(num_requests)}
        for rid, tokens in requests.items():
            mgr.allocate_slots(rid, tokens, len(tokens))
        for step in range(64):
            for rid, tokens in requests.items():
                tokens.append(step)
                if mgr.allocate_slots(rid, tokens, 1, num_computed_tokens=len(tokens) - 1) is None:
                    raise RuntimeError("benchmark pool too small")
            calls += num_requests
        for rid in requests:
            mgr.free(rid)
        round_index += 1
    return calls / (time.perf_counter() - start)


def bench_fast_path(num_calls: int) -> float:
    """Seconds per allocate_slots call that needs no block and hashes nothing."""
    mgr = KVCacheManager(1_000, 16)
    tokens = list(range(20))
    mgr.allocate_slots("r", tokens, 20)
    start = time.perf_counter()
    for _ in range(num_calls):
        mgr.allocate_slots("r", tokens, 1, num_computed_tokens=19)
    return (time.perf_counter() - start) / num_calls


def main() -> None:
    print("block pool: allocate 4 + prefix-hit 2 + free 6 blocks per op")
    print(f"{'blocks':>8} {'ember ops/s':>12} {'deque ops/s':>12} {'speed-up':>9}")
    for num_blocks in (1_000, 10_000, 100_000):
        ours, theirs = bench_pools(num_blocks, seconds=2.0)
        print(f"{num_blocks:>8} {ours:>12,.0f} {theirs:>12,.0f} {ours / theirs:>8.1f}x")

    print("\nallocate_slots in decode (100-token prompts, 64 steps, block_size 16)")
    print(f"{'blocks':>8} {'ember calls/s':>14} {'nano calls/s':>14} {'speed-up':>9}")
    for num_blocks in (1_000, 10_000, 100_000):
        ours = bench_decode(KVCacheManager(num_blocks, 16), num_blocks, seconds=2.0)
        theirs = bench_decode(NanoVLLMBlockManager(num_blocks, 16), num_blocks, seconds=2.0)
        print(f"{num_blocks:>8} {ours:>14,.0f} {theirs:>14,.0f} {ours / theirs:>8.1f}x")

    per_call = bench_fast_path(200_000)
    print(f"\nallocate_slots common path (no new block, nothing to hash): {per_call * 1e6:.2f} us")


if __name__ == "__main__":
    main()
