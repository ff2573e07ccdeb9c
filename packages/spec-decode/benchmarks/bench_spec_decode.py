"""Output tokens/s with and without speculative decoding, at batch 1 and batch 8.

The target is a ~30M-parameter Llama (float32, 9 layers of hidden 512) with random weights, run by
the engine (EngineCore + scheduler + InProcessExecutor, greedy, one torch thread). Random weights
produce noise that never repeats, where prompt lookup has nothing to find; so the n-gram workload
uses the same model with its attention output projections set to zero ("looping"): every layer
still runs its attention, but the next token then depends on the last token only, so the greedy
continuation enters a cycle within a few dozen tokens and then repeats itself. Its prompts are a
random seed prompt of 32 tokens followed by the model's own first 96 greedy tokens, so that the
outputs repeat (a cycle that is in) their prompt, as code that repeats earlier blocks does. Both
variants are measured, and the draft model too:

  ngram     prompt lookup (k=4, n from 2 to 4), on the looping target and on the noisy one;
  draft     draft_model (k=4) on the looping target, the draft being the target's first layer
            (same embeddings, final norm and head: an early-exit draft);
  self      the target as its own draft: every draft is accepted, every step pays twice.

Each line prints tokens/s with and without speculation measured in this run, the ratio, the
acceptance rate (accepted / drafted tokens) and the mean acceptance length (tokens per verified
draft run). Greedy outputs with and without speculation are checked to be equal.

    python3 packages/spec-decode/benchmarks/bench_spec_decode.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_spec_decode import SpeculativeConfig
from ember_testing.tiny_models import BENCH_LLAMA_CONFIG, tiny_model_path
from ember_worker.executor import InProcessExecutor

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512


def derived_model(source: pathlib.Path, target: pathlib.Path, *, looping: bool, layers: int | None):
    """A copy of ``source`` with zero attention output projections (``looping``) and/or only
    its first ``layers`` layers."""
    shutil.copytree(source, target, dirs_exist_ok=True)
    weights_file = next(target.glob("*.safetensors"))
    weights = load_file(weights_file)
    if looping:
        for name in weights:
            if name.endswith("self_attn.o_proj.weight"):
                weights[name] = torch.zeros_like(weights[name])
    if layers is not None:
        keep = {f"model.layers.{i}." for i in range(layers)}
        weights = {
            n: w
            for n, w in weights.items()
            if not n.startswith("model.layers.") or any(n.startswith(k) for k in keep)
        }
        config = json.loads((target / "config.json").read_text())
        config["num_hidden_layers"] = layers
        (target / "config.json").write_text(json.dumps(config))
    save_file(weights, weights_file, metadata={"format": "pt"})
    return target


def make_engine(model, max_num_seqs: int, speculative_config: SpeculativeConfig | None):
    executor = InProcessExecutor(
        model,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=1024,
        block_size=BLOCK_SIZE,
        kv_cache_memory=256 * 1024**2,
        num_threads=1,
        speculative_config=speculative_config,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=1024,
        max_model_len=MAX_MODEL_LEN,
        num_lookahead_tokens=speculative_config.num_lookahead_tokens if speculative_config else 0,
    )
    return EngineCore(executor, config)


def generate(core: EngineCore, prompts, max_tokens: int):
    """(outputs, seconds, drafted, accepted, draft runs) of generating every prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{time.monotonic_ns()}-{i}", prompt, params))
    outputs: dict[str, list[int]] = {}
    drafted = accepted = runs = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        step = core.step()
        for out in step.outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        spec = step.scheduler_stats.spec_decoding if step.scheduler_stats else None
        if spec is not None:
            drafted += spec.num_draft_tokens
            accepted += spec.num_accepted_tokens
            runs += spec.num_drafts
    seconds = time.perf_counter() - start
    return (
        [outputs[k] for k in sorted(outputs, key=lambda k: int(k.rsplit("-", 1)[1]))],
        seconds,
        drafted,
        accepted,
        runs,
    )


def measure(name, target, config, prompts_by_batch, max_tokens):
    for batch, prompts in prompts_by_batch.items():
        base_core = make_engine(target, batch, None)
        generate(base_core, prompts[:1], 8)  # warm-up
        base, base_s, _, _, _ = generate(base_core, prompts, max_tokens)
        spec_core = make_engine(target, batch, config)
        generate(spec_core, prompts[:1], 8)
        spec, spec_s, drafted, accepted, runs = generate(spec_core, prompts, max_tokens)
        assert spec == base, f"{name}: outputs differ with speculation"
        tokens = sum(len(o) for o in base)
        base_tps, spec_tps = tokens / base_s, tokens / spec_s
        print(
            f"{name:<28} batch {batch}: {base_tps:7.1f} tok/s without, {spec_tps:7.1f} with "
            f"= {spec_tps / base_tps:4.2f}x; acceptance {accepted / max(drafted, 1):5.1%}, "
            f"mean acceptance length {1 + accepted / max(runs, 1):4.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    seeds = [torch.randint(3, 2000, (32,), generator=gen).tolist() for _ in range(8)]
    noisy = tiny_model_path("llama", **BENCH_LLAMA_CONFIG)
    with tempfile.TemporaryDirectory() as tmp:
        looping = derived_model(noisy, pathlib.Path(tmp) / "looping", looping=True, layers=None)
        early_exit = derived_model(noisy, pathlib.Path(tmp) / "early-exit", looping=True, layers=1)
        own, _, _, _, _ = generate(make_engine(looping, 8, None), seeds, 96)
        repeating = [seed + tokens for seed, tokens in zip(seeds, own)]
        by_batch = {1: repeating[:1], 8: repeating}
        print(f"threads: {torch.get_num_threads()}, output tokens per request: {args.max_tokens}")
        ngram = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4)
        measure("ngram, looping target", looping, ngram, by_batch, args.max_tokens)
        measure("ngram, noisy target", noisy, ngram, {1: seeds[:1], 8: seeds}, args.max_tokens)
        draft = SpeculativeConfig("draft_model", 4, model=str(early_exit))
        measure("draft (1 layer), looping", looping, draft, by_batch, args.max_tokens)
        itself = SpeculativeConfig("draft_model", 4, model=str(looping))
        measure("self-draft, looping", looping, itself, {1: repeating[:1]}, args.max_tokens)


if __name__ == "__main__":
    main()
