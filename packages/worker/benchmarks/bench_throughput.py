"""Offline throughput of the engine against transformers ``generate`` on a ~30M Llama (float32).

Workloads (64 prompts each; this script runs ``random``, ``bench_throughput_fixed.py`` runs
``fixed``, so that each script stays near a minute of CPU time):
  random: prompts of 16-64 tokens, output lengths uniform in [16, 256];
  fixed:  64 prompt tokens, 128 output tokens.
The engine (EngineCore + scheduler + InProcessExecutor) runs every request with continuous
batching. transformers runs static padded batches (left padding) of ``--hf-batch`` prompts in
arrival order, each generating as many tokens as the batch's longest request; only each request's
own tokens count. Both run greedy with the same torch intra-op thread count (``--threads``,
default 1, printed), in this process, one after the other; the script prints output tokens/s and
the engine / transformers ratio.

    python3 packages/worker/benchmarks/bench_throughput.py
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_testing.tiny_models import BENCH_LLAMA_CONFIG, tiny_model_path
from ember_worker.executor import InProcessExecutor

BLOCK_SIZE = 16


def model_path():
    return tiny_model_path("llama", **BENCH_LLAMA_CONFIG)


def workload(kind: str, num_prompts: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "fixed":
        prompts = torch.randint(3, 2000, (num_prompts, 64), generator=gen).tolist()
        return prompts, [128] * num_prompts
    lengths = torch.randint(16, 65, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in lengths]
    return prompts, torch.randint(16, 257, (num_prompts,), generator=gen).tolist()


def make_engine(max_num_seqs: int, max_tokens_per_seq: int, num_threads: int = 1) -> EngineCore:
    executor = InProcessExecutor(
        model_path(),
        dtype="float32",
        max_model_len=512,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        block_size=BLOCK_SIZE,
        # Room for every request at full length: this benchmark measures speed, not preemption.
        kv_cache_memory=max_num_seqs * -(-max_tokens_per_seq // BLOCK_SIZE) * bytes_per_block(),
        num_threads=num_threads,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_model_len=512
    )
    return EngineCore(executor, config)


def bytes_per_block() -> int:
    o = BENCH_LLAMA_CONFIG
    return 2 * o["num_hidden_layers"] * BLOCK_SIZE * o["num_key_value_heads"] * o["head_dim"] * 4


def run_engine(core: EngineCore, prompts, output_lens, tag: str) -> int:
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        core.add_request(EngineCoreRequest(f"{tag}{i}", prompt, params))
    produced = 0
    while core.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in core.step().outputs)
    return produced


def run_hf(model, prompts, output_lens, batch_size: int) -> int:
    produced = 0
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        lens = output_lens[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, prompt in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        steps = max(lens)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=steps,
                do_sample=False,
                pad_token_id=0,
            )
        assert out.shape[1] == width + steps
        produced += sum(lens)
    return produced


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--workloads", default="random", help="comma-separated: random, fixed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    args = parser.parse_args(argv)
    core = make_engine(args.num_prompts, 64 + 256, args.threads)  # sets torch's thread count
    hf = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # every batch runs its full length, as ignore_eos
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    threads = torch.get_num_threads()
    assert threads == args.threads, f"torch runs {threads} threads, asked for {args.threads}"
    print(
        f"model: llama {params:.1f}M parameters, float32, {threads} torch thread(s) on both sides"
    )
    run_engine(core, [[5, 6, 7]] * 4, [4] * 4, "warmup")  # first-call costs out of the timings
    run_hf(hf, [[5, 6, 7]] * 4, [4] * 4, 4)

    print(f"{'workload':<10}{'engine tok/s':>14}{'hf tok/s':>12}{'ratio':>8}")
    for kind in args.workloads.split(","):
        prompts, output_lens = workload(kind, args.num_prompts)
        t0 = time.perf_counter()
        produced = run_engine(core, prompts, output_lens, kind)
        engine_s = time.perf_counter() - t0
        assert produced == sum(output_lens)
        t0 = time.perf_counter()
        hf_produced = run_hf(hf, prompts, output_lens, args.hf_batch)
        hf_s = time.perf_counter() - t0
        engine_rate, hf_rate = produced / engine_s, hf_produced / hf_s
        print(f"{kind:<10}{engine_rate:>14.0f}{hf_rate:>12.0f}{engine_rate / hf_rate:>8.2f}x")


if __name__ == "__main__":
    main()
