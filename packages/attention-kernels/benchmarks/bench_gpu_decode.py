"""GPU decode attention: achieved memory bandwidth and time against contiguous-KV SDPA.

For each batch size and KV length, one decode step of ``ek.paged_attention`` (Triton, bf16, pages
shuffled over the pool) is timed with CUDA events and its achieved bandwidth (bytes of K and V
read per step / time) is printed as a fraction of the device's copy bandwidth, measured in the
same run with a large device-to-device copy. The baseline is torch
``scaled_dot_product_attention`` on the same KV laid out contiguously ([batch, kv_heads, len,
head], no paging; ``enable_gqa=True`` shares each KV head, no repeat). The kernel's output is
checked against SDPA before timing.

    python3 packages/attention-kernels/benchmarks/bench_gpu_decode.py

Exits with a message (status 0) where no CUDA device is present.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import ember_kernels as ek


def cuda_time(fn, repeats: int) -> float:
    """Median seconds per call over ``repeats`` calls, after warm-up, with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() / seconds


def bench(batch, kv_len, num_q_heads, num_kv_heads, head_size, block_size, dtype, repeats):
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages_per_seq = -(-kv_len // block_size)
    num_blocks = batch * pages_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device="cuda", dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda")
    block_table = perm.view(batch, pages_per_seq).int()
    query = torch.randn(batch, num_q_heads, head_size, generator=gen, device="cuda", dtype=dtype)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    out = torch.empty_like(query)
    scale = head_size**-0.5

    def paged():
        ek.paged_attention(
            query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
            scale=scale, max_query_len=1, max_seq_len=kv_len, out=out,
        )  # fmt: skip

    # Contiguous KV for SDPA, [batch, kv_heads, len, head]; SDPA's GQA mode shares each KV head
    # among its query heads, so the baseline reads the same bytes as the paged kernel.
    keys = key_cache[block_table.long()].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
    values = value_cache[block_table.long()].flatten(1, 2)[:, :kv_len].transpose(1, 2).contiguous()
    q4 = query[:, :, None, :]  # [batch, q_heads, 1, head]

    def sdpa():
        return F.scaled_dot_product_attention(q4, keys, values, scale=scale, enable_gqa=True)

    paged()
    expected = sdpa()[:, :, 0]
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    t_paged = cuda_time(paged, repeats)
    t_sdpa = cuda_time(sdpa, repeats)
    kv_bytes = 2 * batch * kv_len * num_kv_heads * head_size * key_cache.element_size()
    return t_paged, t_sdpa, kv_bytes / t_paged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    ns = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_gpu_decode: no CUDA device here; nothing to measure.")
        return
    dtype = torch.bfloat16
    peak = copy_bandwidth(ns.repeats)
    print(
        f"{torch.cuda.get_device_name()}: copy bandwidth {peak / 1e9:.0f} GB/s; decode, bf16, "
        f"q/kv heads {ns.q_heads}/{ns.kv_heads}, head {ns.head_size}, block {ns.block_size}"
    )
    print(
        f"{'batch':>6} {'kv_len':>7} {'paged us':>9} {'GB/s':>7} {'of copy':>8} {'SDPA us':>9} {'SDPA/paged':>11}"
    )
    for batch in (1, 8, 32, 128):
        for kv_len in (1024, 4096, 16384):
            if batch * kv_len > 128 * 4096:
                continue
            t_paged, t_sdpa, bandwidth = bench(
                batch, kv_len, ns.q_heads, ns.kv_heads, ns.head_size, ns.block_size, dtype,
                ns.repeats,
            )  # fmt: skip
            print(
                f"{batch:>6} {kv_len:>7} {t_paged * 1e6:>9.1f} {bandwidth / 1e9:>7.0f} "
                f"{bandwidth / peak:>8.0%} {t_sdpa * 1e6:>9.1f} {t_sdpa / t_paged:>10.2f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
