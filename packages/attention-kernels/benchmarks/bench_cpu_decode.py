"""CPU decode-step attention: ember_kernels.paged_attention against a naive per-sequence loop.

One decode step of 64 sequences with 1,024 cached tokens each, pages shuffled over the pool. The
baseline is ``reference.paged_attention_reference`` (a Python loop over sequences: gather its
pages, attend) measured in the same run; a second line times ``scaled_dot_product_attention`` on
the same KV already contiguous (no paging), as a floor. Prints times and ratios.

    python3 packages/attention-kernels/benchmarks/bench_cpu_decode.py [--seqs 64] [--kv-len 1024]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F

import ember_kernels as ek
from ember_kernels.reference import paged_attention_reference


def best_times(fns: dict, repeats: int) -> dict:
    """Best wall time of each function over ``repeats`` rounds, the functions interleaved within a
    round so that load from other processes falls on all of them alike."""
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def decode_batch(num_seqs, kv_len, num_q_heads, num_kv_heads, head_size, block_size, gen):
    pages_per_seq = -(-kv_len // block_size)
    num_blocks = num_seqs * pages_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    block_table = torch.randperm(num_blocks, generator=gen).view(num_seqs, pages_per_seq).int()
    query = torch.randn(num_seqs, num_q_heads, head_size, generator=gen)
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), kv_len, dtype=torch.int32)
    return query, key_cache, value_cache, block_table, query_start_loc, seq_lens


def run(num_seqs, kv_len, num_q_heads, num_kv_heads, head_size, block_size, repeats):
    gen = torch.Generator().manual_seed(0)
    args = decode_batch(num_seqs, kv_len, num_q_heads, num_kv_heads, head_size, block_size, gen)
    query, key_cache, value_cache, block_table, _, _ = args
    scale = head_size**-0.5
    out = torch.empty_like(query)

    def ember():
        ek.paged_attention(*args, scale=scale, max_query_len=1, max_seq_len=kv_len, out=out)

    # The CPU path reuses its batch plan while the metadata is unchanged (the later layers of a
    # step); alternating two batches that differ by one token rebuilds it on every call (the
    # first layer of a step).
    batches = itertools.cycle([args, (*args[:5], args[5] - 1)])

    def ember_new_plan():
        batch = next(batches)
        ek.paged_attention(*batch, scale=scale, max_query_len=1, max_seq_len=kv_len, out=out)

    def naive():
        paged_attention_reference(*args, scale=scale)

    # The same KV as contiguous [seqs, kv_heads, kv_len, head] tensors, prepared outside the timing.
    keys = key_cache[block_table.long()].flatten(1, 2).transpose(1, 2).contiguous()
    values = value_cache[block_table.long()].flatten(1, 2).transpose(1, 2).contiguous()
    q = query.view(num_seqs, num_kv_heads, -1, head_size)

    def contiguous_sdpa():
        F.scaled_dot_product_attention(q, keys, values, scale=scale)

    torch.testing.assert_close(
        ek.paged_attention(*args, scale=scale), paged_attention_reference(*args, scale=scale)
    )
    times = best_times(
        {"naive": naive, "new": ember_new_plan, "ember": ember, "sdpa": contiguous_sdpa}, repeats
    )
    t_naive, t_new, t_ember, t_sdpa = times["naive"], times["new"], times["ember"], times["sdpa"]
    kv_mib = 2 * key_cache.numel() * key_cache.element_size() / 2**20
    print(
        f"decode step, {num_seqs} seqs x {kv_len} tokens, q/kv heads {num_q_heads}/{num_kv_heads}, "
        f"head {head_size}, block {block_size}, fp32 ({kv_mib:.0f} MiB of KV), "
        f"{torch.get_num_threads()} threads"
    )
    print(f"  naive per-sequence loop          {t_naive * 1e3:8.2f} ms   1.00x")
    for label, t in (("plan built ", t_new), ("plan reused", t_ember)):
        print(f"  ek.paged_attention, {label}  {t * 1e3:8.2f} ms   {t_naive / t:5.2f}x faster")
    print(
        f"  contiguous SDPA (no pages)       {t_sdpa * 1e3:8.2f} ms   {t_naive / t_sdpa:5.2f}x faster"
        "   (floor: no gather)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ns = parser.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    # A tiny test model's shape (the worker's CPU case) and a mid-size GQA shape.
    run(ns.seqs, ns.kv_len, 4, 2, 32, 16, ns.repeats)
    run(ns.seqs, ns.kv_len, 16, 4, 64, 16, ns.repeats)


if __name__ == "__main__":
    main()
