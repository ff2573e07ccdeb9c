"""CPU paged attention: the compiled kernel against the torch path, a naive loop and a floor.

Two steps, pages shuffled over the pool, fp32: a decode step of 64 sequences with 1,024 cached
tokens each, and the prefill of one 1,500-token prompt (causal). Each is timed for
``cpu_ops.paged_attention`` (the compiled kernel, read in place from the pages), the torch path
``torch_ops.paged_attention`` (gather the pages, then SDPA), the naive per-sequence reference
(decode only) and ``scaled_dot_product_attention`` on the same KV already contiguous
(``enable_gqa``, ``is_causal``: no pages to follow, the floor), interleaved in the same run.
Then ``--bf16-decode``: the compiled kernel alone on a bfloat16 decode step of the
Qwen2.5-0.5B shape (32 sequences, 14/2 heads of 64) at a few context lengths, the KV of 24
layers cycled so that each call finds its layer's KV out of the caches, as in a model's step.
With one thread (the default) the times are the calling thread's CPU time, which other processes
on a shared machine do not inflate; with more, wall time.

    python3 packages/attention-kernels/benchmarks/bench_cpu_attention.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from ember_kernels import cpu_ops, torch_ops
from ember_kernels.reference import paged_attention_reference


def best_times(fns: dict, repeats: int) -> dict:
    """Best time of each function over ``repeats`` rounds, the functions interleaved within a
    round so that load from other processes falls on all of them alike."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for fn in fns.values():
        fn()  # warm-up
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def paged_batch(lengths, num_q_heads, num_kv_heads, head_size, block_size, gen):
    """(q_len, seq_len) sequences with their pages shuffled over a pool."""
    pages = [-(-seq_len // block_size) for _, seq_len in lengths]
    num_blocks = sum(pages)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen)
    value_cache = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).int()
    block_table = torch.zeros(len(lengths), max(pages), dtype=torch.int32)
    starts = [0, *torch.tensor(pages).cumsum(0).tolist()]
    for seq, n in enumerate(pages):
        block_table[seq, :n] = order[starts[seq] : starts[seq] + n]
    q_lens = torch.tensor([q for q, _ in lengths], dtype=torch.int32)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()])
    query = torch.randn(int(q_lens.sum()), num_q_heads, head_size, generator=gen)
    seq_lens = torch.tensor([s for _, s in lengths], dtype=torch.int32)
    return query, key_cache, value_cache, block_table, query_start_loc, seq_lens


def run(title, lengths, num_q_heads, num_kv_heads, head_size, repeats, naive_too):
    gen = torch.Generator().manual_seed(0)
    args = paged_batch(lengths, num_q_heads, num_kv_heads, head_size, 16, gen)
    query, key_cache, value_cache, block_table, _, seq_lens = args
    scale = head_size**-0.5
    out = torch.empty_like(query)
    # The same KV as contiguous [seqs, kv_heads, len, head] (all sequences have one length here).
    length = int(seq_lens[0])
    keys = key_cache[block_table.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    values = value_cache[block_table.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    q = query.view(len(lengths), -1, num_q_heads, head_size).transpose(1, 2)
    causal = lengths[0][0] > 1
    fns = {
        "compiled": lambda: cpu_ops.paged_attention(*args, scale=scale, out=out),
        "torch": lambda: torch_ops.paged_attention(*args, scale=scale, out=out),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q, keys, values, scale=scale, is_causal=causal, enable_gqa=True
        ),
    }
    if naive_too:
        fns["naive"] = lambda: paged_attention_reference(*args, scale=scale)
    expected = paged_attention_reference(
        *(t.double() if t.is_floating_point() else t for t in args), scale=scale
    )
    actual = cpu_ops.paged_attention(*args, scale=scale).double()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    times = best_times(fns, repeats)
    kv_mib = 2 * key_cache.numel() * key_cache.element_size() / 2**20
    print(
        f"{title}: q/kv heads {num_q_heads}/{num_kv_heads}, head {head_size}, block 16, fp32 "
        f"({kv_mib:.0f} MiB of KV), {torch.get_num_threads()} threads"
    )
    base = times["torch"]
    labels = {
        "naive": "naive per-sequence loop",
        "torch": "torch path (gather + SDPA)",
        "compiled": "compiled kernel (in place)",
        "sdpa": "SDPA on contiguous KV (floor)",
    }
    for name in ("naive", "torch", "compiled", "sdpa"):
        if name in times:
            t = times[name]
            print(f"  {labels[name]:32} {t * 1e3:8.2f} ms   {base / t:5.2f}x the torch path")


def bf16_decode(contexts, repeats: int, layers: int = 24) -> None:
    """Per-layer time of the compiled kernel on a bfloat16 decode step of the 0.5B shape."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    print(f"bf16 decode, 32 seqs, heads 14/2 of 64, KV of {layers} layers cycled")
    for context in contexts:
        steps = [paged_batch([(1, context)] * 32, 14, 2, 64, 16, gen) for _ in range(layers)]
        steps = [[t.bfloat16() if t.is_floating_point() else t for t in s] for s in steps]
        out = torch.empty_like(steps[0][0])
        best = float("inf")
        for round_ in range(repeats + 1):  # the first round warms up
            start = clock()
            for args in steps:
                cpu_ops.paged_attention(*args, scale=0.125, out=out)
            if round_:
                best = min(best, (clock() - start) / layers)
        print(f"  context {context:5}: {best * 1e6:8.1f} us per layer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--bf16-decode", action="store_true", help="only the bf16 decode step")
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    if not cpu_ops.available():
        print("bench_cpu_attention: the compiled CPU kernels are unavailable here (see the log).")
        return
    if ns.bf16_decode:
        bf16_decode((80, 128, 512), 3 * ns.repeats)
        return
    # The tiny Llama (4/2 heads of 64) and a wider GQA shape (8/2).
    for q_heads, kv_heads in ((4, 2), (8, 2)):
        run("decode, 64 seqs x 1,024", [(1, 1024)] * 64, q_heads, kv_heads, 64, ns.repeats, True)
        run("prefill, 1,500 tokens", [(1500, 1500)], q_heads, kv_heads, 64, ns.repeats, False)


if __name__ == "__main__":
    main()
