"""Where a decode step's time goes: model forward, paged attention within it, and the rest.

Runs the ~30M float32 Llama of ``bench_throughput`` through EngineCore at batch 1, 16 and 64
(64-token prompts, decode steps only are timed, on ``--threads`` torch threads) and splits each
step into the model forward (decoder + logits, timed around the calls), the paged-attention
layers inside it (cache write + ``ember_kernels.paged_attention``, timed around each
``PagedAttention``), and everything outside the forward: scheduling, the persistent-batch update
and input preparation, sampling, and output processing. Prints per-step milliseconds and shares;
the ratio compares each batch's step time with batch 1's, measured in the same run.

    python3 packages/worker/benchmarks/bench_step_overhead.py
"""

from __future__ import annotations

import argparse
import functools
import time

from bench_throughput import make_engine, workload

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.layers.attention import PagedAttention


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


def measure(batch: int, decode_steps: int, threads: int) -> tuple[float, float, float]:
    """Mean (step, forward, attention) seconds over ``decode_steps`` decode steps at ``batch``."""
    core = make_engine(batch, 64 + decode_steps + 8, threads)
    model = core.executor.model_runner.model
    timer, attention = ForwardTimer(), ForwardTimer()
    model.forward = timer.wrap(model.forward)
    model.compute_logits = timer.wrap(model.compute_logits)
    for layer in model.modules():
        if isinstance(layer, PagedAttention):
            layer.forward = attention.wrap(layer.forward)
    prompts, _ = workload("fixed", batch, seed=batch)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()  # prefill, untimed
    core.step()
    timer.seconds = attention.seconds = 0.0
    start = time.perf_counter()
    for _ in range(decode_steps):
        core.step()
    total = time.perf_counter() - start
    return total / decode_steps, timer.seconds / decode_steps, attention.seconds / decode_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    print(f"{args.threads} torch thread(s)")
    print(f"{'batch':>6}{'step ms':>10}{'forward ms':>12}{'attention ms':>18}{'outside fwd ms':>18}"
          f"{'step / batch-1 step':>21}")  # fmt: skip
    base = None
    for batch in map(int, args.batches.split(",")):
        step, forward, attention = measure(batch, args.steps, args.threads)
        base = base or step
        outside = step - forward
        print(
            f"{batch:>6}{step * 1e3:>10.2f}{forward * 1e3:>12.2f}"
            f"{attention * 1e3:>10.2f} ({attention / step:>4.0%}){outside * 1e3:>10.2f} "
            f"({outside / step:>4.1%}){step / base:>21.2f}"
        )


if __name__ == "__main__":
    main()
