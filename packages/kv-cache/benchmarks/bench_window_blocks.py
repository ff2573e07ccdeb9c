"""KV blocks one sequence holds against its context length: a sliding-window model's stay flat
beyond the window, a full-attention model's grow with every block of tokens.

A Mistral-shaped setting (window 4096, blocks of 16): one sequence prefills a 512-token prompt,
then decodes up to 32k tokens; at each context length the table prints the blocks held (not the
null block) under ``LocalAttentionManager`` and ``KVCacheManager``, and the decode step's time
per call (the window manager frees a block once per 16 steps).

Run: python3 benchmarks/bench_window_blocks.py
"""

from __future__ import annotations

import time

from ember_kv_cache import KVCacheManager, LocalAttentionManager, SlidingWindowSpec

BLOCK_SIZE, WINDOW, PROMPT, LONGEST = 16, 4096, 512, 32768
REPORT_AT = (1024, 2048, 4096, 8192, 16384, 32768)


def held_blocks(manager, request_id: str) -> int:
    return sum(1 for block in manager.get_block_ids(request_id) if block)


def run(manager) -> tuple[dict[int, int], float]:
    """Blocks held at each reported length, and microseconds per decode ``allocate_slots``."""
    tokens = list(range(PROMPT))
    manager.allocate_slots("seq", tokens, PROMPT)
    held, start = {}, time.perf_counter()
    while len(tokens) < LONGEST:
        tokens.append(len(tokens) % 30000)
        if manager.allocate_slots("seq", tokens, 1, num_computed_tokens=len(tokens) - 1) is None:
            raise RuntimeError("out of blocks")
        if len(tokens) in REPORT_AT:
            held[len(tokens)] = held_blocks(manager, "seq")
    per_step = (time.perf_counter() - start) / (LONGEST - PROMPT) * 1e6
    manager.free("seq")
    return held, per_step


def main() -> None:
    num_blocks = LONGEST // BLOCK_SIZE + 2
    window, window_us = run(
        LocalAttentionManager(num_blocks, BLOCK_SIZE, SlidingWindowSpec(WINDOW))
    )
    full, full_us = run(KVCacheManager(num_blocks, BLOCK_SIZE))
    print(f"window {WINDOW}, blocks of {BLOCK_SIZE}: KV blocks held by one sequence")
    print("| context | sliding window | full attention |")
    print("|---|---|---|")
    for length in REPORT_AT:
        print(f"| {length} | {window[length]} | {full[length]} |")
    print(f"decode allocate_slots: {window_us:.2f} µs (window) vs {full_us:.2f} µs (full) per call")


if __name__ == "__main__":
    main()
