"""Block hashing throughput for each hash choice (block_size 16, chained, with and without
extra keys).

Baseline, measured in the same run: the naive recomputation (``naive_baseline.py``), hashing
each block's whole prefix with sha256. Ratios are against that baseline and against sha256.

Run: python3 benchmarks/bench_hashing.py
"""

from __future__ import annotations

import importlib.util
import random
import time

from naive_baseline import NaiveKVCacheManager

from ember_kv_cache import HASH_ALGOS, BlockHasher, BlockHashExtras

BLOCK_SIZE, NUM_TOKENS = 16, 16 * 1024


def _blocks_per_second(fn, num_blocks: int, repeats: int = 7) -> float:
    """Best of ``repeats`` timed calls (the machine is shared: the best run is the least
    disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return num_blocks / best


def main() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(128_000) for _ in range(NUM_TOKENS)]
    num_blocks = NUM_TOKENS // BLOCK_SIZE
    naive = NaiveKVCacheManager(2, BLOCK_SIZE)
    baseline = _blocks_per_second(
        lambda: [naive._prefix_hash(tokens, i + 1) for i in range(num_blocks)], num_blocks, 2
    )
    extras = BlockHashExtras(lora_name="adapter", cache_salt="tenant")
    print(f"chained block hashing, {NUM_TOKENS} tokens in blocks of {BLOCK_SIZE}")
    print(f"naive sha256 over each whole prefix: {baseline:>12,.0f} blocks/s")
    print(
        f"{'algo':>10} {'extras':>7} {'blocks/s':>12} {'MB/s tokens':>12} {'vs naive':>9} {'vs sha256':>10}"
    )
    sha256_rate = None
    for algo in HASH_ALGOS:
        if algo != "sha256" and importlib.util.find_spec("xxhash") is None:
            print(f"{algo:>10}  skipped: pip install 'ember-kv-cache[xxhash]'")
            continue
        hasher = BlockHasher(BLOCK_SIZE, algo)
        for label, block_extras in (("no", None), ("yes", extras)):
            rate = _blocks_per_second(
                lambda h=hasher, e=block_extras: h.hash_prefix(tokens, e), num_blocks
            )
            if sha256_rate is None:
                sha256_rate = rate
            megabytes = rate * BLOCK_SIZE * 4 / 1e6
            print(
                f"{algo:>10} {label:>7} {rate:>12,.0f} {megabytes:>12.1f} "
                f"{rate / baseline:>8.1f}x {rate / sha256_rate:>9.2f}x"
            )


if __name__ == "__main__":
    main()
