"""Offline latency: how long one batch takes from submission to its last token.

Runs ``--num-iters-warmup`` untimed and ``--num-iters`` timed ``LLM.generate`` calls over the same
``--batch-size`` random prompts (greedy, ``ignore_eos``) and reports the mean, p50 and p99.
"""

from __future__ import annotations

import argparse
import time

from ember_server.cli.bench.common import offline_workload, percentiles_ms, write_json
from ember_server.engine.engine_args import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--output-json", default=None, help="Also write the results here.")


def measure(
    engine_args: EngineArgs,
    batch_size: int,
    input_len: int,
    output_len: int,
    num_iters: int,
    num_iters_warmup: int,
) -> dict:
    workload = offline_workload(engine_args, batch_size, input_len, output_len)
    with workload as (llm, prompts, params):
        for _ in range(num_iters_warmup):
            llm.generate(prompts, params, use_tqdm=False)
        latencies = []
        for _ in range(num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
    return dict(
        batch_size=batch_size,
        input_len=input_len,
        output_len=output_len,
        num_iters=num_iters,
        latency=percentiles_ms(latencies, points=(50, 90, 99)),
        latencies_s=latencies,
    )


def main(args: argparse.Namespace) -> int:
    results = measure(
        EngineArgs.from_cli_args(args),
        args.batch_size,
        args.input_len,
        args.output_len,
        args.num_iters,
        args.num_iters_warmup,
    )
    lat = results["latency"]
    print(
        f"latency of a batch of {args.batch_size}: mean {lat['mean_ms']:.1f} ms, "
        f"p50 {lat['p50_ms']:.1f} ms, p90 {lat['p90_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms"
    )
    write_json(args.output_json, results)
    return 0
