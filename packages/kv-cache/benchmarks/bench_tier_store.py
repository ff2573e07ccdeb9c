"""Load and store bandwidth of each KV tier through ``TieredKVStore``.

Chunks of 256 tokens of a 16-layer model with 8 KV heads of 64 (float16): 8 MiB each.
Baseline, measured in the same run: the same tier moving the raw array bytes (``tobytes`` in,
``np.frombuffer`` out) with no entry header, checksum or integrity check: what a store without
them costs. The Redis row runs when
``redis-server`` is on PATH (a throwaway server on a free port).

Run: python3 benchmarks/bench_tier_store.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
from bench_prefix_lookup import best_seconds

from ember_kv_cache import CPUTier, DiskTier, LayoutFingerprint, RedisTier, TieredKVStore

LAYERS, HEADS, HEAD_SIZE, CHUNK, NUM_CHUNKS = 16, 8, 64, 256, 8
FP = LayoutFingerprint("bench", "float16", 16, LAYERS, HEADS, HEAD_SIZE, chunk_size=CHUNK)


def bench_tier(tier, chunks) -> tuple[float, float, float, float]:
    """GB/s (store, load) through the store, then (store, load) of raw bytes on the tier."""
    store = TieredKVStore([tier], FP)
    hashes = [i.to_bytes(32, "little") for i in range(len(chunks))]
    total = sum(c.nbytes for c in chunks) / 1e9
    put = best_seconds(lambda: [store.put(h, c) for h, c in zip(hashes, chunks)], 3)
    get = best_seconds(lambda: [store.get(h) for h in hashes], 3)
    raw_put = best_seconds(
        lambda: [tier.put(f"raw{i}", c.tobytes()) for i, c in enumerate(chunks)], 3
    )
    raw_get = best_seconds(
        lambda: [np.frombuffer(tier.get(f"raw{i}"), np.float16) for i in range(len(chunks))], 3
    )
    return total / put, total / get, total / raw_put, total / raw_get


def _start_redis(directory: str) -> tuple[subprocess.Popen, str] | None:
    """A throwaway redis-server on a unix socket in ``directory`` (None if not installed)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    sock = os.path.join(directory, "redis.sock")
    process = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", sock, "--save", "", "--dir", directory],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not os.path.exists(sock) and time.monotonic() < deadline:
        time.sleep(0.05)
    return process, f"unix://{sock}"


def main() -> None:
    rng = np.random.default_rng(0)
    chunks = [rng.standard_normal((LAYERS, 2, CHUNK, HEADS, HEAD_SIZE)).astype(np.float16)
              for _ in range(NUM_CHUNKS)]  # fmt: skip
    size_mib = chunks[0].nbytes / 2**20
    print(f"tier store: {NUM_CHUNKS} chunks of {size_mib:.0f} MiB (256 tokens, 16 layers, fp16)")
    print(f"{'tier':>6} {'store GB/s':>11} {'load GB/s':>10} {'raw store':>10} {'raw load':>9} "
          f"{'store ratio':>12} {'load ratio':>11}")  # fmt: skip
    with tempfile.TemporaryDirectory() as directory:
        tiers = [("cpu", lambda: CPUTier(1 << 31)), ("disk", lambda: DiskTier(directory, 1 << 31))]
        server = _start_redis(directory)
        if server is not None:
            tiers.append(("redis", lambda: RedisTier(server[1])))
        try:
            for name, make in tiers:
                put, get, raw_put, raw_get = bench_tier(make(), chunks)
                print(f"{name:>6} {put:>11.2f} {get:>10.2f} {raw_put:>10.2f} {raw_get:>9.2f} "
                      f"{put / raw_put:>11.2f}x {get / raw_get:>10.2f}x")  # fmt: skip
        finally:
            if server is not None:
                server[0].kill()
        if server is None:
            print(" redis  skipped: redis-server is not installed")


if __name__ == "__main__":
    main()
