"""Offline throughput, engine vs transformers, on the fixed workload: 64 prompts of 64 tokens,
128 output tokens each (see ``bench_throughput.py`` for the setup).

    python3 packages/worker/benchmarks/bench_throughput_fixed.py
"""

from __future__ import annotations

import sys

from bench_throughput import main

if __name__ == "__main__":
    main(["--workloads", "fixed", *sys.argv[1:]])
