"""Serving efficiency and start-up time of ``ember serve`` on the built-in demo model.

In one run, on the same model and engine settings:
1. offline throughput (``ember bench throughput``'s measurement, engine in this process): the
   baseline;
2. start-up: the time from launching ``python -m ember_server serve`` to the first streamed token
   of a first request;
3. ``ember bench serve``'s sweep at concurrency 1, 16 and 64 against that server.

It prints each level's output tokens/s as a ratio to the offline baseline (the server-to-offline
efficiency: HTTP, SSE, detokenization and the process hop cost what is lost), TTFT and ITL, and the
CPU seconds each process spent on the level (API server, engine core, and this benchmark's client,
which shares the cores), also per output token: the API server's figure is the front end's cost. Timings
on a shared machine are noisy; the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import subprocess
import sys
import time

import httpx

from ember_server.cli.bench import serve as bench_serve
from ember_server.cli.bench import throughput
from ember_server.cli.bench.common import random_prompts, write_json
from ember_server.cli.demo_model import demo_model_path
from ember_server.engine.engine_args import EngineArgs
from ember_testing.serve_process import child_pids, free_port, stop, wait_serving

ENGINE_FLAGS = {"max_model_len": 256, "max_num_seqs": 64}
# Requests per concurrency level: enough to keep every slot busy a few times over.
REQUESTS_PER_LEVEL = {1: 3, 16: 32, 64: 64}
# Every measurement is the best of this many runs: on a shared machine, the least disturbed one.
REPEATS = 2


def _start_server(port: int, extra_flags: list[str] = ()) -> tuple[subprocess.Popen, float]:
    """Launch ``ember serve`` (demo model, unless ``extra_flags`` name another) and stream one
    token; (process, seconds to it)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    command = [sys.executable, "-m", "ember_server", "serve", f"--port={port}", *flags]
    command += extra_flags
    command.append("--uvicorn-log-level=warning")
    start = time.perf_counter()
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    body = dict(prompt=[20, 21, 22, 23], max_tokens=1, stream=True)

    def streams_a_token() -> bool:
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            return any(
                line.startswith("data:") and '"text"' in line for line in response.iter_lines()
            )

    wait_serving(process, streams_a_token, timeout=300)
    return process, time.perf_counter() - start


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_core_pid(server_pid: int) -> int:
    """The engine core process among the server's children, found by its command line (the
    server may have other children, e.g. a compiler building the attention kernel)."""
    for pid in child_pids(server_pid):
        with contextlib.suppress(OSError):
            if (
                b"ember_server.engine.core_process"
                in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            ):
                return pid
    raise RuntimeError(f"ember serve (pid {server_pid}) has no engine core process")


async def _sweep(base_url: str, input_len: int, output_len: int, pids: dict) -> list[dict]:
    model = await bench_serve.server_model(base_url, None)
    # Warm up the batch shapes the levels will use (the first passes of a shape are slow).
    for concurrency in (16, 1):
        warmup = random_prompts(concurrency, input_len, seed=99)
        await bench_serve.run_level(base_url, model, warmup, output_len, concurrency)
    levels = []
    for concurrency, count in REQUESTS_PER_LEVEL.items():
        prompts = random_prompts(count, input_len, seed=concurrency)
        runs = []
        for _ in range(REPEATS):
            before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
            run = await bench_serve.run_level(base_url, model, prompts, output_len, concurrency)
            run["cpu_s"] = {name: _cpu_seconds(pid) - before[name] for name, pid in pids.items()}
            run["cpu_ms_per_token"] = {
                name: 1e3 * seconds / max(run["output_tokens"], 1)
                for name, seconds in run["cpu_s"].items()
            }
            runs.append(run)
        levels.append(max(runs, key=lambda run: run["output_throughput"]))
    return levels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=12)
    parser.add_argument("--offline-prompts", type=int, default=64)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    model = demo_model_path()
    offline = throughput.measure(
        EngineArgs(model=model, **ENGINE_FLAGS),
        args.offline_prompts,
        args.input_len,
        args.output_len,
        repeats=REPEATS,
    )
    baseline = offline["output_throughput"]
    print(
        f"offline baseline: {baseline:.1f} output tok/s "
        f"({args.offline_prompts} requests, {args.input_len} in / {args.output_len} out)"
    )

    port = free_port()
    process, startup_s = _start_server(port)
    try:
        print(f"start-up (command to first streamed token): {startup_s:.1f} s")
        # Where the CPU goes: the API server (HTTP, SSE, detokenizing), the engine core, and this
        # benchmark's own client (it shares the machine's cores with both).
        pids = {
            "api_server": process.pid,
            "engine_core": _engine_core_pid(process.pid),
            "client": os.getpid(),
        }
        levels = asyncio.run(
            _sweep(f"http://127.0.0.1:{port}", args.input_len, args.output_len, pids)
        )
    finally:
        stop(process)

    print(
        f"{'conc':>5} {'reqs':>5} {'req/s':>7} {'out tok/s':>10} {'served/offline':>14} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'failed':>6} "
        f"{'CPU s: api / engine / client':>29} {'CPU ms/token: api / engine':>27}"
    )
    for level in levels:
        level["ratio_to_offline"] = level["output_throughput"] / baseline
        cpu, per_token = level["cpu_s"], level["cpu_ms_per_token"]
        print(
            f"{level['concurrency']:>5} {level['num_requests']:>5} "
            f"{level['request_throughput']:>7.2f} {level['output_throughput']:>10.1f} "
            f"{level['ratio_to_offline']:>13.2f}x {level['ttft']['p50_ms']:>7.0f}ms "
            f"{level['ttft']['p99_ms']:>7.0f}ms {level['itl']['p50_ms']:>6.0f}ms "
            f"{level['itl']['p99_ms']:>6.0f}ms {level['failed']:>6} "
            f"{cpu['api_server']:>13.2f} / {cpu['engine_core']:5.2f} / {cpu['client']:5.2f} "
            f"{per_token['api_server']:>18.3f} / {per_token['engine_core']:.3f}"
        )
    results = dict(offline=offline, startup_s=startup_s, levels=levels)
    write_json(args.output_json, results)
    return 0 if all(level["failed"] == 0 for level in levels) else 1


if __name__ == "__main__":
    raise SystemExit(main())
