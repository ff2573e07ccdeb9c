"""The weight layout of the linear layers on CPU: ``[out, in]`` row-major against input-major.

``F.linear(x, W)`` multiplies by ``W^T``. With ``W`` stored row-major ``[out, in]`` (PyTorch's
default), MKL gets a transposed right operand and repacks it at every call; stored input-major
(``empty_weight``: an ``[in, out]`` buffer viewed as ``[out, in]``), the right operand is plain
row-major and MKL reads it as it is. Same weights, same inputs, interleaved in the same run, for
the projections of the peer benchmark's tiny and wide Llamas and their LM head at 1, 8, 64, 512
and 2,048 tokens; one thread, calling thread's CPU time; the ratio is row-major / input-major
(above 1: input-major faster).

    python3 packages/worker/benchmarks/bench_linear_layout.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ember_worker.layers.linear import empty_weight

# (input, output) of qkv, o, gate_up, down and the LM head.
SHAPES = {
    "tiny": [(256, 512), (256, 256), (256, 1024), (512, 256), (256, 8192)],
    "wide": [(512, 768), (512, 512), (512, 3072), (1536, 512), (512, 8192)],
}
TOKENS = (1, 8, 64, 512, 2048)


def cpu_time(fn, repeats: int) -> float:
    fn()
    start = time.thread_time()
    for _ in range(repeats):
        fn()
    return (time.thread_time() - start) / repeats


def main() -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"{'model':6} {'tokens':>6} {'row-major ms':>13} {'input-major ms':>15} {'ratio':>7}")
    for model, shapes in SHAPES.items():
        pairs = []
        for size_in, size_out in shapes:
            row_major = torch.randn(size_out, size_in, generator=gen)
            input_major = empty_weight(size_out, size_in, torch.float32).data
            input_major.copy_(row_major)
            pairs.append((row_major, input_major))
        for tokens in TOKENS:
            inputs = {n: torch.randn(tokens, n, generator=gen) for n, _ in shapes}
            repeats = max(3, 512 // tokens)
            totals = [0.0, 0.0]
            for _ in range(3):  # interleaved rounds
                for which in (0, 1):
                    totals[which] += sum(
                        cpu_time(lambda w=p[which], x=inputs: F.linear(x[w.shape[1]], w), repeats)
                        for p in pairs
                    )
            print(
                f"{model:6} {tokens:6} {totals[0] / 3 * 1e3:13.3f} {totals[1] / 3 * 1e3:15.3f} "
                f"{totals[0] / totals[1]:6.2f}x"
            )


if __name__ == "__main__":
    main()
