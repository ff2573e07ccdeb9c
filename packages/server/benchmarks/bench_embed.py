"""Embedding throughput: the offline engine against transformers, and ``/v1/embeddings``.

In one run, on the built-in demo model (a Llama, hidden size 128, 4 layers) and the same prompts
of unequal lengths (token ids, 16 to ``--max-len`` tokens):
1. transformers (the baseline): ``AutoModel`` in float32, batches of ``--hf-batch`` prompts sorted
   by length (as sentence-transformers does, so padding wastes little), right padding with an
   attention mask, the last real token's hidden state, L2-normalized;
2. the offline engine: ``LLM(runner="pooling").embed`` over the same prompts (last pooling,
   normalized), as embeddings/s and as a ratio to transformers; the results are checked to agree;
3. ``ember serve --runner pooling``: ``/v1/embeddings`` with one prompt per request at
   concurrency 1, 16 and 64, as embeddings/s and as a ratio to the offline engine (what HTTP,
   JSON and the process hop cost).

Both engines use the same number of torch threads (the engine's default). Prefix caching is
off: every repeat sends the same prompts, which it would otherwise serve from the cache. Timings on a shared
machine are noisy; each figure is the best of ``REPEATS`` runs, and the ratios are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx
import numpy as np

from ember_server.cli.bench.common import FIRST_PLAIN_TOKEN_ID, PROMPT_VOCAB_BOUND, write_json
from ember_server.cli.demo_model import demo_model_path
from ember_server.engine.engine_factory import default_step_threads
from ember_testing.serve_process import free_port, stop, wait_serving

REPEATS = 2
CONCURRENCY = (1, 16, 64)


def unequal_prompts(num: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, max_len + 1, size=num)
    return [rng.integers(FIRST_PLAIN_TOKEN_ID, PROMPT_VOCAB_BOUND, n).tolist() for n in lengths]


def transformers_embed(model, prompts: list[list[int]], batch_size: int) -> np.ndarray:
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    result = np.empty((len(prompts), model.config.hidden_size), dtype=np.float32)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            lengths = torch.tensor([len(prompts[i]) for i in rows])
            ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
            for r, i in enumerate(rows):
                ids[r, : lengths[r]] = torch.tensor(prompts[i])
            mask = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
            hidden = model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
            last = hidden[torch.arange(len(rows)), lengths - 1]
            result[rows] = torch.nn.functional.normalize(last, dim=-1).numpy()
    return result


def best_rate(run, count: int) -> tuple[float, object]:
    """(items per second of the fastest of REPEATS runs, that run's result)."""
    best, value = 0.0, None
    for _ in range(REPEATS):
        start = time.perf_counter()
        value = run()
        best = max(best, count / (time.perf_counter() - start))
    return best, value


def _start_server(model: str, port: int, max_len: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "ember_server", "serve", model, f"--port={port}",
        "--runner=pooling", f"--max-model-len={max_len + 16}", "--no-enable-prefix-caching",
        "--uvicorn-log-level=warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)

    def embeds() -> bool:
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        return httpx.post(url, json={"input": [20, 21]}, timeout=30).status_code == 200

    wait_serving(process, embeds, timeout=300)
    return process


async def _level(url: str, prompts: list[list[int]], concurrency: int) -> tuple[float, int]:
    """(embeddings/s, failed requests) with ``concurrency`` requests in flight."""
    queue = list(reversed(prompts))
    failed = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            nonlocal failed
            while queue:
                prompt = queue.pop()
                response = await client.post(url, json={"input": prompt})
                failed += response.status_code != 200

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(prompts) / (time.perf_counter() - start), failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from transformers import AutoModel

    from ember_server.engine.llm import LLM

    threads = default_step_threads(served=False).large  # as LLM below
    torch.set_num_threads(threads)
    model_path = demo_model_path()
    prompts = unequal_prompts(args.num_prompts, args.max_len)
    num_tokens = sum(map(len, prompts))
    print(
        f"{len(prompts)} prompts, {num_tokens} tokens (16-{args.max_len} each), "
        f"demo model, {threads} torch thread(s)"
    )

    hf_model = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()
    hf_rate, hf_vectors = best_rate(
        lambda: transformers_embed(hf_model, prompts, args.hf_batch), len(prompts)
    )
    llm = LLM(
        model_path,
        runner="pooling",
        max_model_len=args.max_len + 16,
        enable_prefix_caching=False,
    )
    ember_rate, outputs = best_rate(lambda: llm.embed(prompts, use_tqdm=False), len(prompts))
    llm.shutdown()
    ember_vectors = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    max_diff = float(np.abs(ember_vectors - hf_vectors).max())
    print(f"transformers (baseline): {hf_rate:8.1f} embeddings/s (batch {args.hf_batch})")
    print(
        f"ember offline:           {ember_rate:8.1f} embeddings/s  "
        f"{ember_rate / hf_rate:.2f}x transformers  (max |diff| {max_diff:.1e})"
    )

    port = free_port()
    process = _start_server(model_path, port, args.max_len)
    levels = []
    try:
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        asyncio.run(_level(url, prompts[:32], 16))  # warm-up
        for concurrency in CONCURRENCY:
            runs = [asyncio.run(_level(url, prompts, concurrency)) for _ in range(REPEATS)]
            rate, failed = max(runs)
            levels.append(dict(concurrency=concurrency, rate=rate, failed=failed))
            print(
                f"/v1/embeddings conc {concurrency:>2}: {rate:8.1f} embeddings/s  "
                f"{rate / ember_rate:.2f}x offline  {rate / hf_rate:.2f}x transformers  "
                f"failed {failed}"
            )
    finally:
        stop(process, timeout=60)
    write_json(
        args.output_json,
        dict(transformers=hf_rate, offline=ember_rate, max_diff=max_diff, levels=levels),
    )
    return 0 if max_diff < 1e-4 and all(level["failed"] == 0 for level in levels) else 1


if __name__ == "__main__":
    raise SystemExit(main())
