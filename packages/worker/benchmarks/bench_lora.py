"""Decode throughput of batches mixing LoRA adapters against the base model alone.

One batch of ``--batch`` requests (prompts of 32 tokens, ``--output`` tokens out, greedy) runs on
the benchmarks' Llama (``BENCH_LLAMA_CONFIG``, about 30M parameters) in float32, as:

- ``base``: LoRA off (the compiled CPU decoder stack);
- ``base, lora on``: LoRA enabled, no request with an adapter (the same path: a step of the base
  model alone skips the deltas);
- ``1 / 4 / 16 adapters``: every request with an adapter, spread round robin over that many
  adapters of rank ``--rank`` on every projection (``max_loras`` 16: all in one step).

Decode tokens/s counts the steps after every prompt is in (prefill excluded); the overhead is
against ``base``. The configurations take turns for ``--rounds`` rounds and the best round of
each is kept. Adapters are random PEFT folders (``ember_testing.tiny_lora``; needs peft).

    python3 packages/worker/benchmarks/bench_lora.py [--rounds 3] [--threads N] [--tiny]
"""

from __future__ import annotations

import argparse
import time

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.lora import LoRAConfig, LoRARequest
from ember_scheduler.sampling_params import SamplingParams
from ember_testing.tiny_lora import tiny_lora_path
from ember_testing.tiny_models import BENCH_LLAMA_CONFIG, tiny_model_path
from ember_worker.executor import InProcessExecutor

PROMPT_LEN, MAX_LORAS = 32, 16
CONFIGS = ("base", "base, lora on", "1 adapters", "4 adapters", "16 adapters")


def make_engine(base, lora: LoRAConfig | None, batch: int, threads: int | None) -> EngineCore:
    executor = InProcessExecutor(
        str(base),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=batch,
        kv_cache_memory=256 << 20,
        num_threads=threads,
        lora=lora,
    )
    config = SchedulerConfig(max_num_seqs=batch, max_model_len=256, lora=lora)
    return EngineCore(executor, config)


def decode_tokens_per_s(core: EngineCore, requests: list[LoRARequest | None], output: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i, lora in enumerate(requests):
        prompt = [(7 * i + j) % 500 + 3 for j in range(PROMPT_LEN)]
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, lora_request=lora))
    tokens, start = 0, None
    while core.has_unfinished_requests():
        outputs = core.step().outputs
        if start is None and len(outputs) == len(requests):  # every prompt is in
            start = time.perf_counter()
            continue
        if start is not None:
            tokens += sum(len(out.new_token_ids) for out in outputs)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Llama (a smoke run)")
    args = parser.parse_args()
    base = tiny_model_path("llama") if args.tiny else tiny_model_path("llama", **BENCH_LLAMA_CONFIG)
    adapters = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(tiny_lora_path(base, seed=100 + i, r=args.rank, lora_alpha=args.rank)),
        )
        for i in range(16)
    ]
    lora = LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=args.rank, max_cpu_loras=MAX_LORAS)
    engines = {
        "base": make_engine(base, None, args.batch, args.threads),
        "lora": make_engine(base, lora, args.batch, args.threads),
    }
    batches = {
        "base": [None] * args.batch,
        "base, lora on": [None] * args.batch,
        **{f"{k} adapters": [adapters[i % k] for i in range(args.batch)] for k in (1, 4, 16)},
    }
    best = dict.fromkeys(CONFIGS, 0.0)
    for _ in range(args.rounds):
        for name in CONFIGS:
            core = engines["base" if name == "base" else "lora"]
            best[name] = max(best[name], decode_tokens_per_s(core, batches[name], args.output))
    print(f"batch {args.batch}, rank {args.rank}, {args.output} tokens out, best of {args.rounds}")
    print(f"{'configuration':<16} {'decode tok/s':>12} {'overhead':>9}")
    for name in CONFIGS:
        overhead = best["base"] / best[name] - 1
        print(f"{name:<16} {best[name]:>12.1f} {overhead:>8.1%}")


if __name__ == "__main__":
    main()
