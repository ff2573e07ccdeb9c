"""Decode throughput of a small Mixtral-shaped model: Ember, and vLLM's CPU build beside it.

The model is random-weight, written by the test-model factory with Mixtral's structure at a
small size (``MIXTRAL_SMALL``: hidden 512, 8 layers, 8/2 heads of 64, 8 experts of 1024, top 2,
vocabulary 8192). Per engine, the same figures, measured the same way:

- batch 1: one 64-token prompt, decode tokens/s: the time of ``--output`` tokens less the time of
  one (the prompt's prefill and first token), over ``--output - 1`` tokens; the median of
  ``--rounds``;
- batched: ``--batch`` prompts of 64 tokens, ``--output`` tokens each, output tokens/s.

Each engine runs in a child process started with its own interpreter (``run`` subcommand;
everything at module level is standard library, so vLLM's interpreter runs this file too).
``--vllm-python`` adds vLLM twice: at its defaults (on x86 it keeps a core for its scheduler) and
with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (every core computes); the ratio printed is Ember's over
the better of the two. ``--ember-args`` passes JSON settings to Ember's ``LLM`` (for instance
``{"tensor_parallel_size": 2, "enable_expert_parallel": true}``). Figures from a loaded machine
mean nothing: publish only those of a quiet one (the worker README says where they go).

    python packages/worker/benchmarks/bench_moe_decode.py [--dtype bfloat16]
    python packages/worker/benchmarks/bench_moe_decode.py --vllm-python /path/to/vllm/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIXTRAL_SMALL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=8192,
    max_position_embeddings=2048,
)
PROMPT = 64
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 1 << 29
PROMPT_IDS = (16, 1000)  # ordinary token ids of the test tokenizer
VLLM_VARIANTS = {"vllm": {}, "vllm-all-cores": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
RESULT_MARKER = "moe-decode-result: "


def prompts(count: int, seed: int) -> list[list[int]]:
    low, high = PROMPT_IDS
    return [
        [low + (seed * 7919 + i * 104729 + j * 15485863) % (high - low) for j in range(PROMPT)]
        for i in range(count)
    ]


def measure(engine: str, model: str, dtype: str, settings: dict, args) -> dict:
    """The figures of one engine, in this process (the engine's interpreter)."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(model=model, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory_bytes=KV_CACHE_BYTES, enable_prefix_caching=False)  # fmt: skip

        def generate(batch, n):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            inputs = [{"prompt_token_ids": p} for p in batch]
            done = llm.generate(inputs, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in done)
    else:
        from ember_scheduler.sampling_params import SamplingParams
        from ember_server.engine.llm import LLM

        llm = LLM(model, dtype=dtype, max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory=KV_CACHE_BYTES, enable_prefix_caching=False, **settings)  # fmt: skip

        def generate(batch, n):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            done = llm.generate(batch, params, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in done)

    def timed(batch, n):
        start = time.perf_counter()
        tokens = generate(batch, n)
        return time.perf_counter() - start, tokens

    timed(prompts(2, 99), 8)  # warm-up
    rates = []
    for round_ in range(args.rounds):
        one = prompts(1, round_)
        first_s, _ = timed(one, 1)
        all_s, _ = timed(one, args.output)
        rates.append((args.output - 1) / max(all_s - first_s, 1e-9))
    batch_s, tokens = timed(prompts(args.batch, 100), args.output)
    return {"batch1_decode": statistics.median(rates), "batched": tokens / batch_s}


def run_child(python: str, engine: str, model: str, args, env: dict | None = None) -> dict:
    command = [python, __file__, "run", "--engine", engine, "--model", model,
               "--dtype", args.dtype, "--output", str(args.output), "--batch", str(args.batch),
               "--rounds", str(args.rounds), "--ember-args", args.ember_args]  # fmt: skip
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_HOST_IP": "127.0.0.1", **(env or {})},
    )
    if done.returncode != 0:
        raise RuntimeError(f"{engine} run failed:\n{done.stderr[-3000:]}")
    # vLLM logs to stdout too: the figures are the line after the marker.
    line = next(x for x in done.stdout.splitlines() if x.startswith(RESULT_MARKER))
    return json.loads(line[len(RESULT_MARKER) :])


def compare(args) -> None:
    from ember_testing.tiny_models import tiny_model_path

    model = str(tiny_model_path("mixtral", **MIXTRAL_SMALL))
    engines = [("ember", "ember", sys.executable, None)]
    if args.vllm_python:
        engines += [(name, "vllm", args.vllm_python, env) for name, env in VLLM_VARIANTS.items()]
    print(f"{len(os.sched_getaffinity(0))} cores; {args.dtype}; model {model}", flush=True)
    figures = {}
    for name, engine, python, env in engines:
        figures[name] = run_child(python, engine, model, args, env)
        print(f"{name:16} batch 1 {figures[name]['batch1_decode']:8.1f} decode tok/s   "
              f"batch {args.batch} {figures[name]['batched']:8.1f} out tok/s", flush=True)  # fmt: skip
    if args.vllm_python:
        for key in ("batch1_decode", "batched"):
            best = max(figures[name][key] for name in VLLM_VARIANTS)
            print(f"ember / best vLLM, {key}: {figures['ember'][key] / best:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", nargs="?", default="compare", choices=("compare", "run"))
    parser.add_argument("--engine", choices=("ember", "vllm"), default="ember")
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--output", type=int, default=128, help="tokens out per request")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ember-args", default="{}", help="JSON settings for Ember's LLM")
    parser.add_argument("--vllm-python", help="the interpreter of a venv with vLLM's CPU build")
    args = parser.parse_args()
    if args.output < 2:
        parser.error("--output must be at least 2 (decode excludes the first token)")
    if args.command == "run":
        settings = json.loads(args.ember_args)
        result = measure(args.engine, args.model, args.dtype, settings, args)
        print(RESULT_MARKER + json.dumps(result), flush=True)
        return 0
    compare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
