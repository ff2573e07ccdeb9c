"""CPU fused ops: the compiled kernels (``cpu_ops``) against the torch path (``torch_ops``).

The per-layer small operations of a decoder, shaped as one decode step of 64 sequences and as a
512-token prefill, for the tiny Llama of the peer benchmark (hidden 256, heads 4/2, head 64,
intermediate 512) and the wide one (hidden 512, heads 8/2, intermediate 1536), fp32: RMSNorm,
residual add + RMSNorm, SiLU-and-mul, rotary embedding of q and k (read from the fused qkv output
as the model does) and the write of k/v into a paged cache. Each is timed on both paths,
interleaved in the same run, as the calling thread's CPU time (one thread: other processes on a
shared machine do not inflate it); the ratio is torch / compiled (above 1: compiled faster).

    python3 packages/attention-kernels/benchmarks/bench_cpu_fused_ops.py [--repeats 300]
"""

from __future__ import annotations

import argparse
import time

import torch

import ember_kernels as ek
from ember_kernels import cpu_ops, torch_ops

MODELS = {"tiny": (256, 4, 2, 512), "wide": (512, 8, 2, 1536)}  # hidden, heads, kv heads, inter
HEAD = 64
BLOCK = 16


def cases(hidden: int, heads: int, kv_heads: int, inter: int, tokens: int) -> dict:
    """name -> function(backend) running one op on inputs shaped like one layer's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen)
    residual = torch.randn(tokens, hidden, generator=gen)
    weight = torch.rand(hidden, generator=gen) + 0.5
    gate_up = torch.randn(tokens, 2 * inter, generator=gen)
    q_size, kv_size = heads * HEAD, kv_heads * HEAD
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=gen)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = (t.view(tokens, -1, HEAD) for t in (q, k, v))
    rope = ek.RotaryEmbedding(HEAD, HEAD, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    blocks = 4 * (tokens // BLOCK + 1)
    key_cache = torch.zeros(blocks, BLOCK, kv_heads, HEAD)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(blocks * BLOCK, generator=gen)[:tokens]
    return {
        "rms_norm": lambda b: b.rms_norm(x, weight, 1e-6),
        "fused_add_rms_norm": lambda b: b.fused_add_rms_norm(x, residual, weight, 1e-6),
        "silu_and_mul": lambda b: b.silu_and_mul(gate_up),
        "rotary q+k": lambda b: b.rotary_embedding(positions, q, k, rope.cos_sin_cache, True),
        "reshape_and_cache": lambda b: b.reshape_and_cache(k, v, key_cache, value_cache, slots),
    }


def cpu_time(fn, repeats: int) -> float:
    """Best of three rounds of ``repeats`` calls: seconds per call."""
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.thread_time()
        for _ in range(repeats):
            fn()
        best = min(best, (time.thread_time() - start) / repeats)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the compiled CPU kernels could not be built here (see the log line)")
    torch.set_num_threads(1)
    print(f"{'model':6} {'tokens':>6} {'op':20} {'torch us':>9} {'compiled us':>12} {'ratio':>7}")
    for model, shape in MODELS.items():
        for tokens in (64, 512):
            for name, fn in cases(*shape, tokens).items():
                slow = cpu_time(lambda fn=fn: fn(torch_ops), args.repeats)
                fast = cpu_time(lambda fn=fn: fn(cpu_ops), args.repeats)
                print(
                    f"{model:6} {tokens:6} {name:20} {slow * 1e6:9.1f} {fast * 1e6:12.1f} "
                    f"{slow / fast:6.2f}x"
                )


if __name__ == "__main__":
    main()
