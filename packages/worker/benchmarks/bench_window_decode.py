"""Decode throughput of a long-context sliding-window model against the same model with its
window ignored.

One random Mistral of the benchmarks' Llama shape (``BENCH_LLAMA_CONFIG``, about 30M
parameters) is written twice from one seed, so with the same weights: with
``sliding_window=--window`` and without one. Each serves ``--batch`` prompts of
``--context`` tokens through the offline ``LLM`` in float32; a request's decode time is the
time of ``1 + --tokens`` generated tokens less that of 1 (the prefill), so the figure is decode
tokens per second at that context. The window model reads (and holds) only its window's KV;
the full model reads the whole context. The same run measures both, interleaved.
Figures from a loaded machine are only indicative (see the worker README).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember import LLM, SamplingParams
from ember_testing.tiny_models import BENCH_LLAMA_CONFIG, tiny_model_path


def generate_seconds(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 2000, (args.context,), generator=gen).tolist()]
    prompts *= args.batch
    prompts = [[i + 3, *p[1:]] for i, p in enumerate(prompts)]  # no shared prefix
    max_len = args.context + args.tokens + 1
    models = {
        f"window {args.window}": tiny_model_path(
            "mistral", max_position_embeddings=max_len, sliding_window=args.window,
            **BENCH_LLAMA_CONFIG,
        ),
        "window ignored": tiny_model_path(
            "mistral", max_position_embeddings=max_len, **BENCH_LLAMA_CONFIG
        ),
    }  # fmt: skip
    engines = {
        name: LLM(
            str(path),
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=args.batch,
            kv_cache_memory=512 * 1024**2,
            enable_prefix_caching=False,
        )
        for name, path in models.items()
    }
    decode: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():  # interleaved
            prefill = generate_seconds(llm, prompts, 1)
            full = generate_seconds(llm, prompts, 1 + args.tokens)
            decode[name].append(args.batch * args.tokens / max(full - prefill, 1e-9))
    print(f"{torch.get_num_threads()} threads, float32; batch {args.batch}, context "
          f"{args.context}, {args.tokens} decode tokens each; median of {args.repeats}")  # fmt: skip
    for name, rates in decode.items():
        print(f"{name:<16} {statistics.median(rates):8.1f} decode tokens/s")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
