"""What one ``at::parallel_for`` region costs with no work in it: the fork, the join and the
barrier that the compiled decoder stack pays once per matmul and attention of every layer (five
a layer, plus the LM head, at batch 1 with two or more threads).

Times, in microseconds per region, an empty region of one share per thread (the OpenMP team
ATen runs), back to back and after a spell of single-thread work (the norms, rotary and
silu-and-mul that run between the regions, which let the idle threads stop spinning), and one
OpenMP barrier inside a region; the cases take turns over ``--rounds``, so each sees the same load.
A step's region cost is about (5 x layers + 1) times the figure after a gap of that spell.

    python3 packages/worker/benchmarks/bench_parallel_region.py [--threads 2] [--rounds 3]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <chrono>

namespace {
using Clock = std::chrono::steady_clock;

void busy(double microseconds) {
  const auto start = Clock::now();
  while (std::chrono::duration<double, std::micro>(Clock::now() - start).count() < microseconds) {
  }
}
}  // namespace

// Seconds per empty region of one share per thread, each after `gap_us` of one thread's work
// (the gap itself not counted).
double empty_region_seconds(int64_t regions, double gap_us) {
  const int64_t shares = at::get_num_threads();
  double inside = 0.0;
  for (int64_t i = 0; i < regions; ++i) {
    busy(gap_us);
    const auto start = Clock::now();
    at::parallel_for(0, shares, 1, [](int64_t, int64_t) {});
    inside += std::chrono::duration<double>(Clock::now() - start).count();
  }
  return inside / regions;
}

// Seconds per OpenMP barrier among the threads of one region.
double barrier_seconds(int64_t barriers) {
  const auto start = Clock::now();
#pragma omp parallel num_threads(at::get_num_threads())
  for (int64_t i = 0; i < barriers; ++i) {
#pragma omp barrier
  }
  return std::chrono::duration<double>(Clock::now() - start).count() / barriers;
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--regions", type=int, default=20000, help="regions per case and round")
    parser.add_argument(
        "--gaps", default="0,5,20,50", help="microseconds of one thread's work before each region"
    )
    args = parser.parse_args()
    if args.threads < 2:
        raise ValueError(f"threads: a region needs at least 2 threads, got {args.threads}")
    gaps = [float(g) for g in args.gaps.split(",")]
    module = load_inline(
        "ember_bench_parallel_region",
        cpp_sources=SOURCE,
        functions=["empty_region_seconds", "barrier_seconds"],
        extra_cflags=["-O2", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
    )
    torch.set_num_threads(args.threads)
    print(f"torch threads {torch.get_num_threads()}; microseconds per region or barrier")
    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        cells = {}
        for gap in gaps:
            cells[f"region after {gap:g} us"] = module.empty_region_seconds(args.regions, gap)
        cells["barrier"] = module.barrier_seconds(args.regions * 5)
        print(f"round {round_}: " + ", ".join(f"{k} {1e6 * v:.2f}" for k, v in cells.items()))
        for key, seconds in cells.items():
            best[key] = min(best.get(key, seconds), seconds)
    print("best: " + ", ".join(f"{k} {1e6 * v:.2f}" for k, v in best.items()))


if __name__ == "__main__":
    main()
