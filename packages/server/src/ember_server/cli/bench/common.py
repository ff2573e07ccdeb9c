"""Helpers shared by the benchmarks: synthetic prompts, the offline engine over them,
percentiles, JSON reports."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ember_scheduler.sampling_params import SamplingParams
    from ember_server.engine.engine_args import EngineArgs
    from ember_server.engine.llm import LLM

# Low ids are special tokens in most vocabularies (the demo model's are 0-5): keep clear of them.
FIRST_PLAIN_TOKEN_ID = 16
# Prompt ids are drawn below this bound too: valid in any real vocabulary (and the demo model's),
# so offline and serving benchmarks send the same prompts.
PROMPT_VOCAB_BOUND = 1000


def random_prompts(
    num: int, input_len: int, vocab_size: int = PROMPT_VOCAB_BOUND, seed: int = 0
) -> list[list[int]]:
    """``num`` prompts of ``input_len`` random ordinary token ids, reproducible from ``seed``."""
    if vocab_size <= FIRST_PLAIN_TOKEN_ID:
        raise ValueError(f"vocab_size must exceed {FIRST_PLAIN_TOKEN_ID}, got {vocab_size}")
    rng = np.random.default_rng(seed)
    high = min(vocab_size, PROMPT_VOCAB_BOUND)
    return rng.integers(FIRST_PLAIN_TOKEN_ID, high, size=(num, input_len)).tolist()


@contextlib.contextmanager
def offline_workload(
    engine_args: EngineArgs, num_prompts: int, input_len: int, output_len: int
) -> Iterator[tuple[LLM, list[list[int]], SamplingParams]]:
    """``(llm, prompts, params)``: an ``LLM`` of ``engine_args``, ``num_prompts`` random prompts
    of ``input_len`` tokens within its vocabulary (seeded by ``engine_args.seed``), and greedy
    ``ignore_eos`` params, so that every request yields exactly ``output_len`` tokens. The engine
    shuts down on exit."""
    from ember_scheduler.sampling_params import SamplingParams
    from ember_server.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args))
    try:
        vocab_size = llm.model_config.vocab_size
        prompts = random_prompts(num_prompts, input_len, vocab_size, seed=engine_args.seed)
        yield llm, prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    finally:
        llm.shutdown()


def percentiles_ms(values_s: list[float], points=(50, 99)) -> dict[str, float]:
    """``{"p50_ms": ..., "p99_ms": ..., "mean_ms": ...}`` of durations in seconds (NaN if none)."""
    if not values_s:
        return {**{f"p{p}_ms": float("nan") for p in points}, "mean_ms": float("nan")}
    arr = np.asarray(values_s) * 1e3
    result = {f"p{p}_ms": float(np.percentile(arr, p)) for p in points}
    result["mean_ms"] = float(arr.mean())
    return result


def add_workload_args(
    parser: argparse.ArgumentParser, num_prompts: int, input_len: int = 32, output_len: int = 32
) -> None:
    """The random-prompt workload's flags (``--num-prompts``, ``--input-len``, ``--output-len``)
    and ``--output-json``, with these defaults."""
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument(
        "--input-len", type=int, default=input_len, help="Prompt tokens per request."
    )
    parser.add_argument(
        "--output-len", type=int, default=output_len, help="Output tokens per request."
    )
    parser.add_argument("--output-json", default=None, help="Also write the results here.")


def write_json(path: str | None, results: dict) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(results, indent=2) + "\n")
