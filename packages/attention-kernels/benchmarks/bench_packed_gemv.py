"""Batch-1 bfloat16 projections on oneDNN-packed weights: the matrix-vector kernel
(``cpu_ops.packed_linear``) against oneDNN's own matmul, as read bandwidth; and the int8
weight-only kernel (``cpu_ops.int8_linear``, group-wise scales as ``--quantization
int8_weight_only`` makes them) on the same shapes, its bytes the int8 weight and its scales.

The Qwen2.5-0.5B shapes (fused q/k/v 1152x896, output 896x896, gate/up 9728x896, down
896x4864, the LM head 151936x896) at 1 row (``--rows``). Each shape gets enough weight copies
(``--megabytes``, default 256) that a pass over them comes from memory, not the caches, as a
decode step's does. Between timings the benchmark sums a 256 MiB float32 array (a read-only
stream, as a decode step's weights are) and runs a triad (``ember_testing.roofline``'s, two reads
and a write), so the kernels are compared with what the memory gave at that moment: best of
``--repeats`` rounds each, interleaved, on ``--threads`` torch threads (default 1: with two, any
other process on the machine stalls the threads' barriers and swamps the kernels).

    python3 packages/attention-kernels/benchmarks/bench_packed_gemv.py [--threads 1] [--rows 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from ember_kernels import cpu_ops
from ember_kernels.int8_linear import quantize_int8, weight_group_size
from ember_kernels.packed_linear import pack_linear_weight

SHAPES = {
    "qkv": (1152, 896),
    "o_proj": (896, 896),
    "gate_up": (9728, 896),
    "down": (896, 4864),
    "lm_head": (151936, 896),
}


def best_seconds(fn, repeats: int = 1) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def weight_bytes(weight: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes a kernel reads of a weight: a packed bfloat16 one, or an int8 one with its scales."""
    if isinstance(weight, tuple):
        return sum(t.numel() * t.element_size() for t in weight)
    return weight.shape[0] * weight.shape[1] * 2


def measure(n: int, k: int, args, gen, stream, triad) -> tuple[dict, float, float]:
    """Best GB/s of each kernel on a ``[n, k]`` weight, with the best sum and triad bandwidths of
    the same rounds."""
    copies = max(1, (args.megabytes << 20) // (2 * n * k))
    packed = [
        pack_linear_weight(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        for _ in range(copies)
    ]
    int8 = [  # twice the copies: as many bytes as the bfloat16 ones
        quantize_int8(torch.randn(n, k, generator=gen), weight_group_size(k))
        for _ in range(2 * copies)
    ]
    x = torch.randn(args.rows, k, generator=gen).to(torch.bfloat16)
    kernels = {
        "oneDNN": (
            packed,
            lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        ),
        "gemv": (packed, lambda w: cpu_ops.packed_linear(x, w, None)),
        "int8": (int8, lambda w: cpu_ops.int8_linear(x, w[0], w[1], None)),
    }
    best = dict.fromkeys(kernels, 0.0)
    read = triad_bw = 0.0
    a, b, c = triad
    for _ in range(args.repeats):
        read = max(read, stream.numel() * 4 / best_seconds(stream.sum))
        triad_bw = max(
            triad_bw, 3 * a.numel() * 4 / best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a))
        )
        for kernel, (weights, fn) in kernels.items():
            seconds = best_seconds(lambda fn=fn, weights=weights: [fn(w) for w in weights])
            best[kernel] = max(best[kernel], weight_bytes(weights[0]) * len(weights) / seconds)
    return best, read, triad_bw


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    stream = torch.rand(1 << 26, generator=gen)
    triad = [torch.empty(1 << 25), torch.rand(1 << 25, generator=gen), torch.rand(1 << 25)]
    probe = pack_linear_weight(torch.ones(64, 64, dtype=torch.bfloat16))
    applies = cpu_ops.packed_gemv_applies(torch.ones(args.rows, 64, dtype=torch.bfloat16), probe)
    print(f"{args.threads} thread(s), {args.rows} row(s), matrix-vector kernel "
          f"{'runs' if applies else 'does not run (oneDNN twice)'}; GB/s of weight read, best of "
          f"{args.repeats}; ratios against the sum and the triad of the same rounds")  # fmt: skip
    for name, (n, k) in SHAPES.items():
        best, read, triad_bw = measure(n, k, args, gen, stream, triad)
        gbs = {kernel: v / 1e9 for kernel, v in best.items()}
        # int8's time over gemv's, from the bytes each read: 0.5 where int8 streams as fast
        int8_time = (n * k + 4 * n * k // weight_group_size(k)) / best["int8"]
        print(
            f"{name:8} {n:>6}x{k:<5} sum {read / 1e9:5.1f}  triad {triad_bw / 1e9:5.1f}  "
            + "  ".join(
                f"{kernel} {v:5.1f} ({v * 1e9 / read:4.2f} of sum, {v * 1e9 / triad_bw:4.2f} "
                "of triad)"
                for kernel, v in gbs.items()
            )
            + f"  gemv / oneDNN {best['gemv'] / best['oneDNN']:4.2f}x"
            + f"  int8 time / gemv time {int8_time / (2 * n * k / best['gemv']):4.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
