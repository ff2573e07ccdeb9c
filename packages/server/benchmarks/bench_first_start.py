"""The first start of ``ember serve`` on a machine whose compiled-kernel cache is empty, against a
start with that cache warm, in one run.

Each start is the whole command, from launch to: ``/health`` answering 200 (ready), then the first
token of one completion. The empty-cache server keeps running until its background build of the
CPU kernels has put the library into the cache (the time is printed too); the warm start that
follows uses that cache. For the cost a first start paid before the build moved to the
background, the run also times the build alone (a process that only builds the kernels into
another empty cache).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import httpx

from ember_testing.serve_process import free_port, is_healthy, stop, wait_serving

BUILD_ONLY = "from ember_kernels.cpu_ops.build import load_library; assert load_library()"


def _first_token_seconds(base_url: str) -> float:
    """Seconds until the first streamed token of one short completion."""
    model = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    start = time.perf_counter()
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("the completion streamed no token")


def _built(cache: pathlib.Path) -> bool:
    return any(cache.glob("*/ember_cpu_kernels_*.so"))


def serve_once(cache: pathlib.Path, extra: list[str], log: pathlib.Path) -> dict:
    """Start ``ember serve`` with ``cache`` as the kernel cache; the seconds to ready, to the
    first token, and (when the cache started empty) to the library being in the cache."""
    port = free_port()
    env = {**os.environ, "EMBER_KERNELS_CACHE": str(cache)}
    command = [sys.executable, "-m", "ember_server", "serve", f"--port={port}", *extra]
    started_empty = not _built(cache)
    start = time.perf_counter()
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_serving(process, is_healthy(base_url), timeout=600)
        ready = time.perf_counter() - start
        first_token = ready + _first_token_seconds(base_url)
        while not _built(cache) and process.poll() is None:
            time.sleep(0.2)
        built = time.perf_counter() - start if started_empty else 0.0
    finally:
        stop(process)
    return dict(
        ready_s=round(ready, 2), first_token_s=round(first_token, 2), built_s=round(built, 1)
    )


def build_alone_seconds() -> float:
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        env = {**os.environ, "EMBER_KERNELS_CACHE": cache}
        subprocess.run([sys.executable, "-c", BUILD_ONLY], env=env, check=True, timeout=900)
        return round(time.perf_counter() - start, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model folder or name (default: the demo model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--skip-build-alone", action="store_true")
    args = parser.parse_args(argv)
    extra = [f"--dtype={args.dtype}", "--uvicorn-log-level=warning"]
    if args.model:
        extra.insert(0, f"--model={args.model}")
    with tempfile.TemporaryDirectory() as scratch:
        cache = pathlib.Path(scratch) / "cache"
        cache.mkdir()
        results = {"load_avg_1m": round(os.getloadavg()[0], 2)}
        results["empty_cache"] = serve_once(cache, extra, pathlib.Path(scratch) / "cold.log")
        results["warm_cache"] = serve_once(cache, extra, pathlib.Path(scratch) / "warm.log")
        if not args.skip_build_alone:
            results["build_alone_s"] = build_alone_seconds()
        results["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
