"""Offline throughput: a batch of requests through ``LLM.generate`` at once.

Random token-id prompts of ``--input-len`` tokens, greedy, ``ignore_eos`` so that every request
yields exactly ``--output-len`` tokens. Reports requests/s, output tokens/s and total tokens/s.
"""

from __future__ import annotations

import argparse
import time

from ember_server.cli.bench.common import add_workload_args, offline_workload, write_json
from ember_server.engine.engine_args import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, num_prompts=64)
    parser.add_argument("--repeats", type=int, default=1, help="Timed runs; the best is kept.")


def measure(
    engine_args: EngineArgs, num_prompts: int, input_len: int, output_len: int, repeats: int = 1
) -> dict:
    """Build the engine, warm it up, then time ``generate`` over every prompt (best of
    ``repeats`` runs: on a shared machine the best run is the least disturbed one)."""
    workload = offline_workload(engine_args, num_prompts, input_len, output_len)
    with workload as (llm, prompts, params):
        # Warm up: the first passes of each batch shape are slow.
        llm.generate(prompts[:16], params.clone(max_tokens=4), use_tqdm=False)
        elapsed = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = min(elapsed, time.perf_counter() - start)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(
        num_requests=num_prompts,
        input_len=input_len,
        output_len=output_len,
        elapsed_s=elapsed,
        request_throughput=num_prompts / elapsed,
        output_throughput=output_tokens / elapsed,
        total_throughput=(output_tokens + num_prompts * input_len) / elapsed,
    )


def main(args: argparse.Namespace) -> int:
    results = measure(
        EngineArgs.from_cli_args(args),
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.repeats,
    )
    print(
        f"throughput: {results['request_throughput']:.2f} requests/s, "
        f"{results['output_throughput']:.1f} output tokens/s, "
        f"{results['total_throughput']:.1f} total tokens/s "
        f"({results['num_requests']} requests in {results['elapsed_s']:.2f} s)"
    )
    write_json(args.output_json, results)
    return 0
