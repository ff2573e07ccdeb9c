"""Cost of a prefix-cache lookup for a 32k-token prompt (block_size 16).

Baseline, measured in the same run: nano-vllm's block manager (``nano_vllm_baseline.py``), which
chains xxh64 block hashes as ember chains sha256 ones. Prints milliseconds per lookup for a full
hit (every block but the last cached) and for a miss on the first block, and the ratio.

Run: python3 benchmarks/bench_prefix_lookup.py
"""

from __future__ import annotations

import random
import time

from nano_vllm_baseline import NanoVLLMBlockManager

from ember_kv_cache import KVCacheManager

PROMPT_TOKENS, BLOCK_SIZE = 32 * 1024, 16
NUM_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE + 16


def best_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (the machine is shared: the least disturbed)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    other = [rng.randrange(128_000) for _ in range(PROMPT_TOKENS)]
    ours = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
    nano = NanoVLLMBlockManager(NUM_BLOCKS, BLOCK_SIZE)
    ours.allocate_slots("warm", prompt, PROMPT_TOKENS)
    nano.allocate_slots("warm", prompt, PROMPT_TOKENS)
    hit = ours.get_computed_blocks("probe", prompt)
    assert hit.num_computed_tokens == PROMPT_TOKENS - BLOCK_SIZE
    assert len(nano.get_computed_blocks(prompt)) == len(hit.block_ids)

    print(f"prefix lookup, {PROMPT_TOKENS} token prompt, block_size {BLOCK_SIZE}")
    print(f"{'case':>10} {'ember ms':>10} {'nano ms':>10} {'ratio':>9}")
    for case, tokens, repeats in (("full hit", prompt, 10), ("miss", other, 200)):
        t_ours = best_seconds(lambda t=tokens: ours.get_computed_blocks("probe", t), repeats)
        t_nano = best_seconds(lambda t=tokens: nano.get_computed_blocks(t), repeats)
        print(f"{case:>10} {t_ours * 1e3:>10.3f} {t_nano * 1e3:>10.3f} {t_nano / t_ours:>8.2f}x")


if __name__ == "__main__":
    main()
