"""Throughput of ``ember serve -dp 2`` against ``-dp 1`` on the built-in demo model.

In one run, each server in turn (one torch thread per engine core, so DP=2 uses two cores where
DP=1 uses one), through ``ember bench serve``'s streaming client:
1. random prompts at a fixed concurrency: output tokens/s, DP=2 as a ratio to DP=1;
2. shared prefixes: groups of requests whose prompts share a long prefix, groups interleaved;
   the prefix-cache hit rate (``ember:prefix_cache_hits / queries``) shows whether the router
   keeps each group on the engine holding its prefix (a router blind to the caches would split
   each group over both engines and compute every prefix twice).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys

import httpx

from ember_server.cli.bench import serve as bench_serve
from ember_server.cli.bench.common import add_workload_args, random_prompts, write_json
from ember_testing.serve_process import free_port, is_healthy, stop, wait_serving

ENGINE_FLAGS = {"max_model_len": 512, "max_num_seqs": 64, "num_threads": 1}


def _start_server(port: int, dp: int) -> subprocess.Popen:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    command = [sys.executable, "-m", "ember_server", "serve", f"--port={port}", "-dp", str(dp)]
    command += [*flags, "--uvicorn-log-level=warning"]
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    wait_serving(process, is_healthy(f"http://127.0.0.1:{port}"), timeout=600)
    return process


def _counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for name in ("prefix_cache_queries", "prefix_cache_hits"):
        pattern = rf"^ember:{name}_total\{{[^}}]*\}} (\S+)$"
        totals[name] = sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))
    routed = re.findall(
        r'^ember:dp_routed_requests_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)$', text, re.M
    )
    for reason, value in routed:
        totals[f"routed_{reason}"] = totals.get(f"routed_{reason}", 0.0) + float(value)
    return totals


def _shared_prefix_prompts(groups: int, per_group: int, prefix_len: int, suffix_len: int):
    prefixes = random_prompts(groups, prefix_len, seed=7)
    suffixes = random_prompts(groups * per_group, suffix_len, seed=8)
    # Interleaved: request i belongs to group i % groups.
    return [prefixes[i % groups] + suffixes[i] for i in range(groups * per_group)]


async def _measure(base_url: str, args) -> dict:
    model = await bench_serve.server_model(base_url, None)
    await bench_serve.run_level(base_url, model, random_prompts(8, 32, seed=99), 4, 8)  # warm-up
    prompts = random_prompts(args.num_prompts, args.input_len, seed=1)
    random_level = await bench_serve.run_level(
        base_url, model, prompts, args.output_len, args.concurrency
    )
    before = _counters(base_url)
    shared = _shared_prefix_prompts(args.groups, args.per_group, args.prefix_len, 16)
    shared_level = await bench_serve.run_level(
        base_url, model, shared, args.output_len, args.concurrency
    )
    after = _counters(base_url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    shared_level["prefix_hit_rate"] = delta["prefix_cache_hits"] / max(
        1.0, delta["prefix_cache_queries"]
    )
    shared_level["routed"] = {k[7:]: v for k, v in delta.items() if k.startswith("routed_")}
    return dict(random=random_level, shared_prefix=shared_level)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(parser, num_prompts=96, input_len=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--per-group", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    results = {}
    for dp in (1, 2):
        port = free_port()
        process = _start_server(port, dp)
        try:
            results[f"dp{dp}"] = asyncio.run(_measure(f"http://127.0.0.1:{port}", args))
        finally:
            stop(process)

    print(
        f"{'':>4} {'workload':>14} {'reqs':>5} {'out tok/s':>10} {'vs DP=1':>8} "
        f"{'TTFT p50':>9} {'ITL p50':>8} {'prefix hits':>11} {'failed':>6}"
    )
    failed = 0
    for dp in (1, 2):
        for workload in ("random", "shared_prefix"):
            level = results[f"dp{dp}"][workload]
            base = results["dp1"][workload]["output_throughput"]
            level["ratio_to_dp1"] = level["output_throughput"] / base
            hits = f"{level['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in level else ""
            failed += level["failed"]
            print(
                f"DP={dp} {workload:>14} {level['num_requests']:>5} "
                f"{level['output_throughput']:>10.1f} {level['ratio_to_dp1']:>7.2f}x "
                f"{level['ttft']['p50_ms']:>7.0f}ms {level['itl']['p50_ms']:>6.0f}ms "
                f"{hits:>11} {level['failed']:>6}"
            )
    print(f"DP=2 shared-prefix routing: {results['dp2']['shared_prefix']['routed']}")
    write_json(args.output_json, results)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
