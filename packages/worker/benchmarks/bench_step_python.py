"""The host time of a decode step where the model's compute is negligible: the engine's Python
(scheduler, persistent batch, inputs, sampler, outputs) and its small torch and numpy calls.

A Qwen2-shaped test model with tiny layers (``tiny_model_path("qwen2")``) in bfloat16, with
``--vocab`` entries (a small vocabulary leaves the LM head and the logits out of it), runs greedy
decode steps of ``--batch`` requests on one torch thread; the clock is the thread's CPU time
(``time.thread_time``), which other processes on the machine inflate far less than wall time.
Each round times ``--steps`` steps after its prefill; the best round is the figure.

    python3 packages/worker/benchmarks/bench_step_python.py [--batch 1] [--vocab 1024]
"""

from __future__ import annotations

import argparse
import time

import torch

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_testing.tiny_models import tiny_model_path
from ember_worker.executor import InProcessExecutor

MAX_SEQS, MAX_MODEL_LEN, PROMPT = 32, 512, 64


def make_engine(vocab: int) -> EngineCore:
    executor = InProcessExecutor(
        tiny_model_path("qwen2", vocab_size=vocab),
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_SEQS,
        kv_cache_memory=1 << 28,
        num_threads=1,
    )
    config = SchedulerConfig(
        max_num_seqs=MAX_SEQS, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN
    )
    return EngineCore(executor, config)


def decode_round(core: EngineCore, batch: int, steps: int, tag: str, seed: int) -> float:
    """CPU seconds per decode step of ``batch`` requests (after their prefill)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    for i, prompt in enumerate(torch.randint(16, 1000, (batch, PROMPT), generator=gen).tolist()):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params))
    core.step()  # the prefill
    start, count = time.thread_time(), 0
    while core.has_unfinished_requests():
        core.step()
        count += 1
    return (time.thread_time() - start) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1, help=f"requests, at most {MAX_SEQS}")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not 1 <= args.batch <= MAX_SEQS:
        raise ValueError(f"--batch must be in [1, {MAX_SEQS}], got {args.batch}")
    torch.set_num_threads(1)
    core = make_engine(args.vocab)
    decode_round(core, args.batch, 8, "warmup", seed=0)
    rounds = [
        decode_round(core, args.batch, args.steps, f"r{r}", seed=1 + r) for r in range(args.rounds)
    ]
    print(
        f"batch {args.batch}, vocab {args.vocab}: CPU ms per decode step "
        + " ".join(f"{1e3 * s:.3f}" for s in rounds)
        + f"; best {1e3 * min(rounds):.3f}"
    )


if __name__ == "__main__":
    main()
