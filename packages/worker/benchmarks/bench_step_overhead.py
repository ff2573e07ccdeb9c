"""Engine overhead: the share of each decode step spent outside the model forward.

Runs the ~30M float32 Llama of ``bench_throughput`` through EngineCore at batch 1, 16 and 64
(64-token prompts, decode steps only are timed) and splits each step into the model forward
(decoder + logits, timed around the calls) and everything else: scheduling, the persistent-batch
update and input preparation, sampling, and output processing. Prints per-step milliseconds and
the overhead share; the ratio compares each batch's step time with batch 1's, measured in the
same run.

    python3 packages/worker/benchmarks/bench_step_overhead.py
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from bench_throughput import make_engine, workload

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams


class ForwardTimer:
    """Accumulates wall time spent inside the wrapped model calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def measure(batch: int, decode_steps: int) -> tuple[float, float]:
    """Mean (step seconds, forward seconds) over ``decode_steps`` decode steps at ``batch``."""
    core = make_engine(batch, 64 + decode_steps + 8)
    model = core.executor.model_runner.model
    timer = ForwardTimer()
    model.forward = timer.wrap(model.forward)
    model.compute_logits = timer.wrap(model.compute_logits)
    prompts, _ = workload("fixed", batch, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()  # prefill, untimed
    core.step()
    timer.seconds = 0.0
    start = time.perf_counter()
    for _ in range(decode_steps):
        core.step()
    total = time.perf_counter() - start
    return total / decode_steps, timer.seconds / decode_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{'batch':>6}{'step ms':>10}{'forward ms':>12}{'overhead ms':>13}{'overhead':>10}"
          f"{'step / batch-1 step':>21}")  # fmt: skip
    base = None
    for batch in map(int, args.batches.split(",")):
        step, forward = measure(batch, args.steps)
        base = base or step
        print(
            f"{batch:>6}{step * 1e3:>10.2f}{forward * 1e3:>12.2f}{(step - forward) * 1e3:>13.2f}"
            f"{(step - forward) / step:>10.1%}{step / base:>21.2f}"
        )


if __name__ == "__main__":
    main()
