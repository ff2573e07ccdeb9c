"""Serving benchmark: a concurrency sweep of streamed completions against a running server.

For each concurrency level it sends ``--num-prompts`` requests (random token-id prompts, greedy,
``ignore_eos`` so every request yields exactly ``--output-len`` tokens), at most ``concurrency``
in flight, and reports request throughput, output tokens/s, time to first token and inter-token
latency (p50, p99). As in vLLM's benchmark, the first token is the first chunk that carries a
choice, whatever its text (a random-weight model's tokens mostly render as nothing), and ITL is
measured between such chunks.

The client is aiohttp, as in vLLM's serving benchmark: where the load generator shares the cores
with the server, the client's own time per streamed chunk counts as the server's time to first
token, and httpx costs several times aiohttp's (``bench_client_overhead.py`` measures both against
a canned local server; the server README has the figures).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import time

import aiohttp

from ember_server.cli.bench.common import (
    add_workload_args,
    percentiles_ms,
    random_prompts,
    write_json,
)


@dataclasses.dataclass
class RequestResult:
    """What one streamed request measured."""

    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = dataclasses.field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    error: str = ""


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server's URL.")
    parser.add_argument("--model", default=None, help="Model name; default: the server's model.")
    parser.add_argument("--api-key", default=os.environ.get("EMBER_API_KEY"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--seed", type=int, default=0)
    add_workload_args(parser, num_prompts=64)


async def _stream_one(
    session: aiohttp.ClientSession, url: str, body: dict, headers: dict
) -> RequestResult:
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = start
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200]!r}"
                return result
            async for raw_line in response.content:
                line = raw_line.decode()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:  # a token, its text possibly empty (or held back)
                    now = time.perf_counter()
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    return result


async def server_model(base_url: str, api_key: str | None) -> str:
    """The name of the (first) model a server serves."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout, raise_for_status=True) as session,
        session.get(f"{base_url}/v1/models", headers=headers) as response,
    ):
        return (await response.json())["data"][0]["id"]


async def run_level(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int | list[int],
    concurrency: int,
    api_key: str | None = None,
) -> dict:
    """Send every prompt with at most ``concurrency`` in flight; the level's summary.

    ``output_len`` is every request's ``max_tokens``, or one per prompt (a mixed workload)."""
    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    max_tokens = [output_len] * len(prompts) if isinstance(output_len, int) else output_len
    if len(max_tokens) != len(prompts):
        raise ValueError(f"{len(max_tokens)} output lengths for {len(prompts)} prompts")
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=None)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(prompt: list[int], max_tokens: int) -> RequestResult:
            body = dict(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                ignore_eos=True,
                stream=True,
                stream_options={"include_usage": True},
            )
            async with gate:
                return await _stream_one(session, url, body, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(p, n) for p, n in zip(prompts, max_tokens)))
        duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    errors = sorted({r.error for r in results if not r.ok})
    return dict(
        concurrency=concurrency,
        num_requests=len(prompts),
        completed=len(done),
        failed=len(prompts) - len(done),
        errors=errors[:5],
        duration_s=duration,
        request_throughput=len(done) / duration,
        output_throughput=output_tokens / duration,
        output_tokens=output_tokens,
        ttft=percentiles_ms([r.ttft_s for r in done]),
        itl=percentiles_ms([x for r in done for x in r.itl_s]),
        e2e=percentiles_ms([r.e2e_s for r in done]),
    )


async def sweep(
    base_url: str,
    concurrencies: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    model: str | None = None,
    api_key: str | None = None,
    seed: int = 0,
) -> dict:
    """A warm-up round, then ``run_level`` at each concurrency (at least one prompt each)."""
    base_url = base_url.rstrip("/")
    model = model or await server_model(base_url, api_key)
    # The first passes of each batch shape are slow: warm up at the sweep's middle concurrency.
    warm = sorted(concurrencies)[len(concurrencies) // 2]
    warmup = random_prompts(warm, input_len, seed=seed + 1)
    await run_level(base_url, model, warmup, output_len, warm, api_key)
    levels = []
    for concurrency in concurrencies:
        prompts = random_prompts(max(num_prompts, concurrency), input_len, seed=seed)
        levels.append(await run_level(base_url, model, prompts, output_len, concurrency, api_key))
    return dict(
        base_url=base_url, model=model, input_len=input_len, output_len=output_len, levels=levels
    )


def format_table(results: dict) -> str:
    lines = [
        f"{'conc':>5} {'req/s':>8} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'ITL p50':>8} {'ITL p99':>8} {'failed':>6}"
    ]
    for level in results["levels"]:
        lines.append(
            f"{level['concurrency']:>5} {level['request_throughput']:>8.2f} "
            f"{level['output_throughput']:>10.1f} {level['ttft']['p50_ms']:>7.1f}ms "
            f"{level['ttft']['p99_ms']:>7.1f}ms {level['itl']['p50_ms']:>6.1f}ms "
            f"{level['itl']['p99_ms']:>6.1f}ms {level['failed']:>6}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    results = asyncio.run(
        sweep(
            args.base_url,
            args.concurrency,
            args.num_prompts,
            args.input_len,
            args.output_len,
            model=args.model,
            api_key=args.api_key,
            seed=args.seed,
        )
    )
    print(format_table(results))
    write_json(args.output_json, results)
    return 0 if all(level["completed"] for level in results["levels"]) else 1
