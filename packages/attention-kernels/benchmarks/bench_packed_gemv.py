"""bfloat16 or float32 steps of 1-32 rows on oneDNN-packed weights: Ember's streaming kernel
(``cpu_ops.packed_linear``) against oneDNN's own matmul on the same packed weight, and on a CPU
with AMX-BF16 Ember's AMX tiles too, per row count, with the path the engine takes at each
(``cpu_features.packed_gemv_max_rows()``: 32 rows, 2 on a CPU with AMX-BF16; then
``amx_gemm_max_rows()``) and the row cap the run suggests; and, beside bfloat16, the int8
weight-only kernel (``cpu_ops.int8_linear``, group-wise scales as ``--quantization
int8_weight_only`` makes them) on the same shapes, its bytes the int8 weight and its scales.
``--dtype float32`` times float32 steps (the kernel's AVX-512 multiply-adds against oneDNN's
float32 matmul; its own cap, ``packed_gemv_max_rows(torch.float32)``).

The Qwen2.5-0.5B shapes (fused q/k/v 1152x896, output 896x896, gate/up 9728x896, down
896x4864, the LM head 151936x896) at each of ``--rows`` (default 1-32). Each shape gets enough
weight copies (``--megabytes``, default 256) that a pass over them comes from memory, not the
caches, as a decode step's does. Between timings the benchmark sums a 256 MiB float32 array (a
read-only stream, as a decode step's weights are) and runs a triad (``ember_testing.roofline``'s,
two reads and a write), so the kernels are compared with what the memory gave at that moment:
best of ``--repeats`` rounds each, interleaved, on ``--threads`` torch threads (default 1: with
two, any other process on the machine stalls the threads' barriers and swamps the kernels).
Each of Ember's kernels is timed at every row count (its cap set for the call); the engine column
says which path a step of that many rows runs by default.

    python3 packages/attention-kernels/benchmarks/bench_packed_gemv.py [--threads 1] [--rows 1-32]
        [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import time

import torch

from ember_kernels import cpu_features, cpu_ops
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
    """Bytes a kernel reads of a weight: a packed one, or an int8 one with its scales."""
    if isinstance(weight, tuple):
        return sum(t.numel() * t.element_size() for t in weight)
    return weight.shape[0] * weight.shape[1] * weight.element_size()


def parse_rows(text: str) -> list[int]:
    """``1-32`` or ``1,2,4``: row counts of at least 1."""
    rows: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        rows.extend(range(int(first), int(last or first) + 1))
    if not rows or min(rows) < 1:
        raise ValueError(f"--rows: row counts of at least 1, got {text!r}")
    return rows


def capped(stream_rows: int, amx_rows: int, fn, dtype: torch.dtype):
    """``fn`` run with the streaming kernel's (for ``dtype``) and the AMX tiles' row caps set."""

    def run(w):
        cpu_ops.set_packed_gemv_max_rows(stream_rows, dtype)
        cpu_ops.set_amx_gemm_max_rows(amx_rows)
        return fn(w)

    return run


def engine_path(x: torch.Tensor, weight: torch.Tensor, caps: tuple[int, int]) -> str:
    """The path ``packed_linear`` takes for ``x`` under this CPU's row caps, as the kernels say."""
    cpu_ops.set_packed_gemv_max_rows(caps[0], x.dtype)
    cpu_ops.set_amx_gemm_max_rows(caps[1])
    if cpu_ops.packed_gemv_applies(x, weight):
        return "Ember"
    return "AMX" if cpu_ops.amx_gemm_applies(x, weight) else "oneDNN"


def measure(n: int, k: int, rows: list[int], args, gen, stream, triad):
    """Per row count, the best GB/s of weight read of each kernel on copies of a ``[n, k]``
    weight, with the best sum and triad bandwidths of the same rounds and the path the engine
    takes (``engine_path``)."""
    size = args.dtype.itemsize
    copies = max(1, (args.megabytes << 20) // (size * n * k))
    packed = [
        pack_linear_weight(torch.randn(n, k, generator=gen).to(args.dtype)) for _ in range(copies)
    ]
    int8 = [  # as many bytes as the packed copies
        quantize_int8(torch.randn(n, k, generator=gen), weight_group_size(k))
        for _ in range(size * copies if args.int8 else 0)
    ]
    width = cpu_ops.packed_block_width(packed[0])  # the layout check, once, before the timings
    a, b, c = triad
    results = {}
    for m in rows:
        x = torch.randn(m, k, generator=gen).to(args.dtype)
        kernels = {
            "oneDNN": (
                packed,
                lambda w, x=x: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
            ),
            "Ember": (
                packed,
                capped(m, 0, lambda w, x=x: cpu_ops.packed_linear(x, w, None), args.dtype),
            ),
        }
        if args.int8:
            kernels["int8"] = (int8, lambda w, x=x: cpu_ops.int8_linear(x, w[0], w[1], None))
        if args.amx:
            kernels["AMX"] = (
                packed,
                capped(0, m, lambda w, x=x: cpu_ops.packed_linear(x, w, None), args.dtype),
            )
        best = dict.fromkeys(kernels, 0.0)
        read = triad_bw = 0.0
        for _ in range(args.repeats):
            read = max(read, stream.numel() * 4 / best_seconds(stream.sum))
            triad_bw = max(
                triad_bw,
                3 * a.numel() * 4 / best_seconds(lambda: torch.add(b, c, alpha=3.0, out=a)),
            )
            for kernel, (weights, fn) in kernels.items():
                seconds = best_seconds(lambda fn=fn, weights=weights: [fn(w) for w in weights])
                best[kernel] = max(best[kernel], weight_bytes(weights[0]) * len(weights) / seconds)
        results[m] = (best, read, triad_bw, engine_path(x, packed[0], args.caps))
    return results, width


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", type=parse_rows, default=parse_rows("1-32"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.int8 = args.dtype == torch.bfloat16  # the int8 kernel's bfloat16 steps, beside bfloat16
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    stream = torch.rand(1 << 26, generator=gen)
    triad = [torch.empty(1 << 25), torch.rand(1 << 25, generator=gen), torch.rand(1 << 25)]
    cap = cpu_features.packed_gemv_max_rows(args.dtype)
    amx_cap = cpu_features.amx_gemm_max_rows()
    args.caps = (cap, amx_cap)
    args.amx = args.dtype == torch.bfloat16 and cpu_ops.amx_gemm_applies(
        torch.zeros(32, 64, dtype=torch.bfloat16),
        pack_linear_weight(torch.randn(64, 64, generator=gen).bfloat16()),
    )
    print(
        f"{args.threads} thread(s), {args.dtype}; CPU: {cpu_features.describe()}; the engine runs "
        f"Ember's kernel for steps of up to {cap} rows where the layout is one it reads"
        + (f", AMX tiles up to {amx_cap} rows on 32-wide blocks" if args.amx else "")
        + f"; GB/s of weight read, best of {args.repeats}; ratios against the sum and the triad "
        "of the same rounds"
    )
    others = ["oneDNN", "AMX"] if args.amx else ["oneDNN"]
    wins: dict[int, list[float]] = {m: [] for m in args.rows}  # Ember over the best other
    amx_wins: dict[int, list[float]] = {m: [] for m in args.rows}  # AMX over oneDNN
    try:
        for name, (n, k) in SHAPES.items():
            results, width = measure(n, k, args.rows, args, gen, stream, triad)
            layout = f"{width}-wide blocks" if width else "a layout Ember does not read"
            print(f"{name} {n}x{k}: oneDNN packed it in {layout}", flush=True)
            for m, (best, read, triad_bw, engine) in results.items():
                gbs = {kernel: v / 1e9 for kernel, v in best.items()}
                ratio = best["Ember"] / max(best[other] for other in others)
                wins[m].append(ratio if width else 0.0)
                if args.amx:
                    amx_wins[m].append(best["AMX"] / best["oneDNN"] if width == 32 else 0.0)
                size = args.dtype.itemsize
                int8_column = ""
                if args.int8:  # time over Ember's, from the bytes each read: 0.5 if as fast
                    int8_time = (n * k + 4 * n * k // weight_group_size(k)) / best["int8"]
                    over_ember = int8_time * best["Ember"] / (size * n * k)
                    int8_column = f"  int8 time / Ember time {over_ember:4.2f}"
                print(
                    f"  rows {m:2}  sum {read / 1e9:5.1f}  triad {triad_bw / 1e9:5.1f}  "
                    + "  ".join(
                        f"{kernel} {v:5.1f} ({v * 1e9 / read:4.2f} of sum, "
                        f"{v * 1e9 / triad_bw:4.2f} of triad)"
                        for kernel, v in gbs.items()
                    )
                    + "  GFLOP/s "
                    + " ".join(f"{kernel} {2 * m / size * v:6.1f}" for kernel, v in gbs.items())
                    + f"  Ember / {' or '.join(others)} {ratio:4.2f}x  engine runs {engine}"
                    + int8_column,
                    flush=True,
                )
    finally:
        cpu_ops.set_packed_gemv_max_rows(cap, args.dtype)
        cpu_ops.set_amx_gemm_max_rows(amx_cap)
    # The cap this run supports: the most rows up to which Ember's kernel was at least as fast as
    # the other paths on every shape at every row count measured.
    suggested = 0
    for m in sorted(wins):
        if min(wins[m]) < 1.0:
            break
        suggested = m
    print(
        f"Ember / {' or '.join(others)} per row count, slowest shape: "
        + ", ".join(f"{m}: {min(wins[m]):.2f}x" for m in sorted(wins))
    )
    if args.amx:
        print(
            "AMX / oneDNN per row count, slowest shape: "
            + ", ".join(f"{m}: {min(amx_wins[m]):.2f}x" for m in sorted(amx_wins))
        )
    print(
        f"suggested cap (Ember at least as fast on every shape up to it): {suggested} rows; "
        f"this CPU's cap (cpu_features.packed_gemv_max_rows({args.dtype})): {cap}"
    )


if __name__ == "__main__":
    main()
