"""LoRA shrink + expand of one fused q/k/v projection on the CPU: one matmul per adapter present
(the torch path) against the compiled row-by-row kernels, by rows and adapters per batch.

The crossing point sets ``ember_kernels.lora.COMPILED_MAX_ROWS_PER_ADAPTER``. Float32 and
bfloat16, rank 16, hidden 512, q/k/v outputs 512/256/256, 16 slots, B in the worker's layout.

    python3 packages/attention-kernels/benchmarks/bench_lora_kernels.py [--threads 1] [--iters 100] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch

from ember_kernels import cpu_ops
from ember_kernels.lora import LoRAMapping
from ember_kernels.torch_ops import lora as torch_lora

SLOTS, RANK, HIDDEN, OUTS = 16, 16, 512, (512, 256, 256)


def run(backend: str, x, a, bs, slots) -> torch.Tensor:
    rows = x.shape[0]
    y = torch.zeros(rows, sum(OUTS), dtype=x.dtype)
    h = torch.empty(rows, a.shape[1], dtype=x.dtype)
    if backend == "segmented":
        groups = LoRAMapping(slots, SLOTS).groups()
        torch_lora.lora_shrink(x, a, groups, 1.0, h)
    else:
        cpu_ops.lora_shrink(x, a, slots, 1.0, h)
    offset = 0
    for i, b in enumerate(bs):
        if backend == "segmented":
            torch_lora.lora_expand(y, h, b, groups, offset, i * RANK)
        else:
            cpu_ops.lora_expand(y, h, b, slots, offset, i * RANK)
        offset += b.shape[1]
    return y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the compiled CPU kernels are unavailable here")
    torch.set_num_threads(args.threads)
    for dtype in args.dtypes.split(","):
        print(dtype)
        compare(getattr(torch, dtype), args.iters)


def compare(dtype: torch.dtype, iters: int) -> None:
    a = torch.randn(SLOTS, len(OUTS) * RANK, HIDDEN).to(dtype)
    # B in the worker's layout: the transpose of a contiguous [slots, rank, out].
    bs = [torch.randn(SLOTS, RANK, n).to(dtype).transpose(1, 2) for n in OUTS]
    print(f"{'rows':>5} {'adapters':>8} {'segmented us':>13} {'compiled us':>12}")
    for rows in (1, 16, 32, 64, 256):
        x = torch.randn(rows, HIDDEN).to(dtype)
        for adapters in (1, 4, 16):
            slots = torch.arange(rows) % adapters
            times = []
            for backend in ("segmented", "compiled"):
                run(backend, x, a, bs, slots)
                start = time.perf_counter()
                for _ in range(iters):
                    run(backend, x, a, bs, slots)
                times.append((time.perf_counter() - start) / iters * 1e6)
            print(f"{rows:>5} {adapters:>8} {times[0]:>13.0f} {times[1]:>12.0f}")


if __name__ == "__main__":
    main()
