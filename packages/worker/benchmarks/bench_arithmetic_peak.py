"""How close the matmuls come to what the CPU's arithmetic allows: the instruction peak of its
float32 and bfloat16 multiply-adds, against oneDNN's measured matmul peak (the ``peak`` every
batched roofline in these benchmarks divides by) and Ember's decode-batch kernel with its weight
in cache.

- instruction peak: a loop of independent AVX-512 multiply-adds (``vfmadd231ps``, 32 FLOP each)
  and, where the CPU has AVX512-BF16, of bfloat16 dot products (``vdpbf16ps``, 64 FLOP each) on
  1 to ``--threads`` OpenMP threads, compiled with ``$CC`` (default ``cc``) for this CPU. No data
  moves, so nothing can run faster; an engine whose matmul work would need more than this is
  bounded by arithmetic, whatever its kernels. (AMX tiles are not probed here: on a CPU with
  them the kernel rows below run the AMX path, which goes past this peak, so neither they nor
  the bound are set against it there.)
- oneDNN: ``ember_testing.roofline.matmul_peak`` (512 x 4096 x 4096 on a packed weight).
- Ember, 32 rows: ``cpu_ops.packed_linear`` at a decode batch's 32 rows on a Qwen2.5-0.5B
  q/k/v weight (1152 x 896) small enough to stay in the caches, and on copies of the gate/up
  weight that do not (each call reads its weight from memory, as a decode step does).
- the bound it sets: the peer benchmark's offline fixed workload on the Qwen2.5-0.5B shape (32
  prompts of 64 tokens, 128 out each) holds a fixed number of matmul FLOPs (every prompt token
  and every output token but the last through the layers, every output token through the LM
  head); at the bfloat16 instruction peak no engine runs it faster than the printed out tok/s.
- the bound memory sets, on every CPU (on one with AMX, the one that binds): each of the
  workload's steps (the prefill and every decode step but the last token's) reads every bfloat16
  weight once, so at the best read rate measured here (a triad's, or Ember's one-row kernel
  streaming copies of the gate/up weight, whichever is faster) no engine runs it faster than
  the printed out tok/s.

    python3 packages/worker/benchmarks/bench_arithmetic_peak.py [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import subprocess
import tempfile
import time

import torch
from bench_decode import BATCH, OUTPUT, PROMPT, linear_params, workload_flops

from ember_kernels import cpu_features, cpu_ops
from ember_kernels.packed_linear import pack_linear_weight
from ember_testing.roofline import matmul_peak, triad_bandwidth

# 12 independent accumulators, unrolled so that they live in registers, hide the multiply-add
# latency on every AVX-512 core we know of; the asm barrier keeps the compiler from folding it.
PROBE = r"""
#include <immintrin.h>
#include <omp.h>

#define LOOP(T, ZERO, STEP)                                                   \
  double seconds = 0;                                                         \
  float keep = 0;                                                             \
  double start = omp_get_wtime();                                             \
  _Pragma("omp parallel num_threads(threads) reduction(+ : keep)") {          \
    T a = ZERO, b = ZERO;                                                     \
    __m512 acc[12];                                                           \
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();                \
    for (long n = 0; n < iters; n++) {                                        \
      _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) acc[i] = STEP;    \
      __asm__ volatile("" : "+v"(a));                                         \
    }                                                                         \
    for (int i = 0; i < 12; i++) keep += _mm512_reduce_add_ps(acc[i]);        \
  }                                                                           \
  seconds = omp_get_wtime() - start;                                          \
  *sink = keep;                                                               \
  return seconds;

double fma_f32(int threads, long iters, float* sink) {
  LOOP(__m512, _mm512_set1_ps(1e-9f), _mm512_fmadd_ps(a, b, acc[i]))
}

#ifdef __AVX512BF16__
double dot_bf16(int threads, long iters, float* sink) {
  LOOP(__m512bh, (__m512bh)_mm512_set1_epi16(0x3000), _mm512_dpbf16_ps(acc[i], a, b))
}
#endif
"""
# FLOP per instruction: 16 float32 lanes x 2, or 16 lanes x 2 bfloat16 pairs x 2.
KINDS = {"fma_f32": ("float32 vfmadd231ps", 32), "dot_bf16": ("bfloat16 vdpbf16ps", 64)}


def compile_probe(folder: pathlib.Path) -> ctypes.CDLL | None:
    source, library = folder / "probe.c", folder / "probe.so"
    source.write_text(PROBE)
    cc = os.environ.get("CC", "cc")
    command = [cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(source)]
    done = subprocess.run([*command, "-o", str(library)], capture_output=True, text=True)
    if done.returncode != 0:
        print(f"instruction peak: not measured ({cc} failed: {done.stderr.strip()[:200]})")
        return None
    return ctypes.CDLL(str(library))


def instruction_peak(lib: ctypes.CDLL, kind: str, threads: int, seconds: float = 0.4) -> float:
    """Best FLOP/s of ``kind``'s loop on ``threads`` threads over a few runs of ~``seconds``."""
    fn = getattr(lib, kind)
    fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    sink = ctypes.c_float()
    flop = KINDS[kind][1] * 12 * threads
    iters = 1 << 16
    while fn(threads, iters, ctypes.byref(sink)) < seconds / 4:
        iters *= 2
    return max(flop * iters / fn(threads, iters, ctypes.byref(sink)) for _ in range(5))


def kernel_rate(shape: tuple[int, int], copies: int, rows: int, repeats: int = 7) -> float:
    """Best FLOP/s of ``packed_linear`` at ``rows`` rows over ``copies`` packed copies of a
    random bfloat16 weight of ``shape``, each called in turn."""
    gen = torch.Generator().manual_seed(0)
    n, k = shape
    weights = [
        pack_linear_weight(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        for _ in range(copies)
    ]
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    calls = max(1, int(4e8 // (n * k * rows * copies)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            for w in weights:
                cpu_ops.packed_linear(x, w, None)
        best = min(best, (time.perf_counter() - start) / (calls * copies))
    return 2 * n * k * rows / best


def memory_bound(bandwidth: float, prompts: int = BATCH) -> float:
    """Out tok/s of ``prompts`` requests decoding together when each step (one prefill, then
    decode steps, each giving every request a token) reads every bfloat16 weight of the
    Qwen2.5-0.5B shape once at ``bandwidth`` bytes/s and does nothing else."""
    return prompts * bandwidth / (2 * linear_params())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} thread(s); CPU: {cpu_features.describe()}")
    peaks = {}
    with tempfile.TemporaryDirectory() as folder:
        lib = compile_probe(pathlib.Path(folder))
        for kind, (name, _) in KINDS.items() if lib is not None else ():
            if not hasattr(lib, kind):
                print(f"instruction peak, {name}: this CPU lacks it")
                continue
            rates = [instruction_peak(lib, kind, t) for t in range(1, args.threads + 1)]
            peaks[kind] = rates[-1]
            print(f"instruction peak, {name}: "
                  + ", ".join(f"{t + 1} thread(s) {r / 1e9:.0f} GFLOP/s" for t, r in enumerate(rates)))  # fmt: skip
    for dtype, kind in ((torch.float32, "fma_f32"), (torch.bfloat16, "dot_bf16")):
        rate = matmul_peak(dtype)
        share = (
            f" ({100 * rate / peaks[kind]:.0f}% of the instruction peak)" if kind in peaks else ""
        )
        print(f"oneDNN matmul peak, {dtype}: {rate / 1e9:.0f} GFLOP/s{share}")
    # With AMX the 32-row steps run tiles, which go past the dot-product peak: no share, no bound.
    bf16_peak = None if cpu_features.has_amx_bf16() else peaks.get("dot_bf16")
    gate_up_copies = max(1, (256 << 20) // (9728 * 896 * 2))
    for label, shape, copies in (
        ("q/k/v 1152x896, in cache", (1152, 896), 1),
        ("gate/up 9728x896, from memory", (9728, 896), gate_up_copies),
    ):
        rate = kernel_rate(shape, copies, rows=32)
        share = f" ({100 * rate / bf16_peak:.0f}% of the instruction peak)" if bf16_peak else ""
        print(f"Ember, bfloat16, 32 rows, {label}: {rate / 1e9:.0f} GFLOP/s{share}")
    one_row = kernel_rate((9728, 896), gate_up_copies, rows=1)  # FLOP/s = bytes/s at one row
    triad = triad_bandwidth()
    print(f"bound from memory: each of the offline fixed workload's {OUTPUT} steps reads "
          f"{2 * linear_params() / 1e9:.2f} GB of bfloat16 weights; at the best read rate here "
          f"({max(triad, one_row) / 1e9:.1f} GB/s: triad {triad / 1e9:.1f}, Ember's one-row "
          f"kernel {one_row / 1e9:.1f}) at most {memory_bound(max(triad, one_row)):.0f} out tok/s")  # fmt: skip
    if bf16_peak:
        produced = BATCH * OUTPUT
        flops = workload_flops(BATCH, PROMPT, produced)
        print(f"bound: the offline fixed workload (Qwen2.5-0.5B shape, {BATCH} x {PROMPT} -> "
              f"{OUTPUT}) holds {flops / 1e12:.2f} TFLOP of matmuls; at the bfloat16 instruction "
              f"peak at most {produced * bf16_peak / flops:.0f} out tok/s")  # fmt: skip


if __name__ == "__main__":
    main()
