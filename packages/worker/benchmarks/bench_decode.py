"""Batch-1 decode and batched offline throughput of a Qwen2.5-0.5B-shaped model, fp32 and bf16
(and int8 weight-only, and W8A8 int8), each against its roofline measured in the same run
(``ember_testing.roofline``).

The model is random-weight, written by the test-model factory with Qwen2.5-0.5B's shapes (hidden
896, 24 layers, 14/2 heads of 64, MLP 4864, vocabulary 151936, tied embeddings). The dtypes
take turns (``--rounds``), so both see the same load; the engine runs with every core unless
``--threads`` says otherwise.

- batch 1: one 64-token prompt, 128 tokens out, greedy; decode tokens/s (first token excluded),
  against the bytes a decode step reads (every weight, the tied head included, plus the KV cache
  at the mean context) over the memory bandwidth: a triad and a read-only sum are sampled before
  every round and after the last (``roofline.BandwidthProbe``), and the summary measures each
  dtype's best round against the best triad of the whole run (and shows the best read beside);
- batched: 32 prompts of 64 tokens, 128 out each; output tokens/s and the matmuls' GFLOP/s
  (``workload_flops``: the layers on every prompt token and every produced token but each
  request's last, the LM head on produced tokens only) against the matmul library's peak
  at that dtype, sampled before every round as the bandwidths are (the best so far divides).

A ``--dtypes`` entry ``bfloat16-int8`` (or ``float32-int8``) runs that dtype with
``quantization="int8_weight_only"``: its bytes per token count the linear weights and the head at
one byte each plus their float32 group scales (q/k/v stay in the dtype); its batched peak is the matmul library's at the
activation dtype. An entry ``bfloat16-w8a8`` (or ``float32-w8a8``) runs the same model as a W8A8
int8 compressed-tensors checkpoint (``ember_testing.tiny_models.tiny_w8a8_model_path``: int8
per-channel weights, activations quantized per token): the LM head (tied) stays in the dtype.

    python3 packages/worker/benchmarks/bench_decode.py [--rounds 2] [--dtypes float32,bfloat16]
    python3 packages/worker/benchmarks/bench_decode.py --dtypes bfloat16,bfloat16-int8 --skip-batched
    python3 packages/worker/benchmarks/bench_decode.py --dtypes bfloat16-int8,bfloat16-w8a8
    python3 packages/worker/benchmarks/bench_decode.py --dtypes bfloat16 --skip-batch1

The batched line is followed by its two phases: the prompts' prefill and the decode steps after
it, each with its matmuls' GFLOP/s. ``--split`` then splits each dtype's decode steps by phase
(``step_split``), at batch 1 and at the batch (unless skipped): the compiled stack's phases, the
LM head, the sampler and the rest of the step.
"""

from __future__ import annotations

import argparse
import time

import torch
from step_split import split_decode_steps

from ember_kernels.int8_linear import weight_group_size
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_testing.roofline import BandwidthProbe, batched_roofline, decode_roofline, matmul_peak
from ember_testing.tiny_models import QWEN_05B_CONFIG, tiny_model_path, tiny_w8a8_model_path
from ember_worker.executor import InProcessExecutor

QWEN_05B = QWEN_05B_CONFIG
PROMPT, OUTPUT, BATCH = 64, 128, 32
MAX_MODEL_LEN = 512


INT8_SUFFIX = "-int8"  # int8 weight-only, the head included, q/k/v in the dtype
W8A8_SUFFIX = "-w8a8"  # a W8A8 checkpoint, the head in the dtype


def split_name(name: str) -> tuple[str, str]:
    """(activation dtype, quantization suffix or "") of a ``--dtypes`` entry."""
    for suffix in (INT8_SUFFIX, W8A8_SUFFIX):
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return name, ""


def make_engine(name: str, threads: int | None) -> EngineCore:
    dtype, quantized = split_name(name)
    write = tiny_w8a8_model_path if quantized == W8A8_SUFFIX else tiny_model_path
    executor = InProcessExecutor(
        write("qwen2", **QWEN_05B),
        dtype=dtype,
        quantization="int8_weight_only" if quantized == INT8_SUFFIX else None,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=BATCH,
        kv_cache_memory=1 << 30,
        num_threads=threads,
    )
    config = SchedulerConfig(
        max_num_seqs=BATCH, max_num_batched_tokens=2048, max_model_len=MAX_MODEL_LEN
    )
    return EngineCore(executor, config)


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, 2000, (count, PROMPT), generator=gen).tolist()


def run(
    core: EngineCore, batch: list[list[int]], tag: str, output: int = OUTPUT
) -> tuple[float, float, int]:
    """(seconds to the first output token of every request, seconds after it, tokens out)."""
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i, prompt in enumerate(batch):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params))
    start = time.perf_counter()
    first = None
    produced = 0
    while core.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in core.step().outputs)
        if first is None and produced >= len(batch):
            first = time.perf_counter()
    return first - start, time.perf_counter() - first, produced


def decode_bytes(dtype: torch.dtype, output: int, quantized: str = "") -> float:
    """Bytes one batch-1 decode step reads: every weight (the embedding once, as the tied head)
    and the KV cache at the mean context; quantized (``INT8_SUFFIX``), the linear weights but
    q/k/v (``FLOAT_PROJECTIONS``) and the head at one byte each plus a float32 scale per group of
    inputs (the embedding table is then not read but for one row); ``W8A8_SUFFIX``, every linear
    weight at one byte plus a float32 scale per output channel, the head in ``dtype``."""
    c = QWEN_05B
    hidden, inter, layers, head = c["hidden_size"], c["intermediate_size"], 24, 64
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    per_layer = hidden * (q + 2 * kv) + (q + 2 * kv) + q * hidden + 3 * hidden * inter + 2 * hidden
    weights = layers * per_layer + c["vocab_size"] * hidden + hidden
    kv_per_token = 2 * layers * kv
    mean_context = PROMPT + output / 2
    element = torch.empty((), dtype=dtype).element_size()
    if quantized == INT8_SUFFIX:
        # [out, in] of the int8 weights: o_proj, gate/up, down per layer, and the head
        shapes = [(hidden, q), (2 * inter, hidden), (hidden, inter)] * layers
        shapes.append((c["vocab_size"], hidden))
        int8 = sum(out * k for out, k in shapes)
        scales = sum(out * (k // weight_group_size(k)) for out, k in shapes)
        return int8 + 4 * scales + (weights - int8 + kv_per_token * mean_context) * element
    if quantized:
        linear, rows = linear_params(with_head=False), linear_rows(with_head=False)
        return linear + 4 * rows + (weights - linear + kv_per_token * mean_context) * element
    return (weights + kv_per_token * mean_context) * element


def linear_params(with_head: bool = True) -> int:
    c = QWEN_05B
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], 64
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return c["num_hidden_layers"] * per_layer + with_head * c["vocab_size"] * hidden


def linear_rows(with_head: bool = True) -> int:
    """Output channels of the linear weights and (``with_head``) the head: one W8A8 scale each."""
    c = QWEN_05B
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], 64
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    per_layer = (q + 2 * kv) + hidden + 2 * inter + hidden
    return c["num_hidden_layers"] * per_layer + with_head * c["vocab_size"]


def workload_flops(prompts: int, prompt: int, produced: int) -> float:
    """Matmul FLOPs of ``prompts`` requests of ``prompt`` tokens producing ``produced`` tokens in
    all: every prompt token and every produced token but each request's last through the layers,
    the head on each produced token only (a prefill runs it on each prompt's last token)."""
    layers = linear_params(with_head=False)
    head = linear_params() - layers
    return 2 * (layers * (prompts * prompt + produced - prompts) + head * produced)


def phase_line(first_s: float, rest_s: float, produced: int) -> str:
    """The batched run's two phases: the prompts' prefill (to every request's first token) and
    the decode steps after it, each with its matmuls' GFLOP/s (the head on the rows it runs)."""
    prefill = workload_flops(BATCH, PROMPT, BATCH)
    steps = produced // BATCH - 1
    decode = workload_flops(BATCH, PROMPT, produced) - prefill
    return (
        f"prefill of {BATCH} x {PROMPT} tokens {first_s:.2f} s ({prefill / first_s / 1e9:.0f} "
        f"GFLOP/s), {steps} decode steps {1e3 * rest_s / steps:.1f} ms each "
        f"({decode / rest_s / 1e9:.0f} GFLOP/s)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--skip-batched", action="store_true")
    parser.add_argument("--skip-batch1", action="store_true")
    parser.add_argument("--output", type=int, default=OUTPUT, help="tokens out per request")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--split", action="store_true", help="split decode steps by phase")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    engines = {name: make_engine(name, args.threads) for name in dtypes}
    for name, core in engines.items():
        run(core, prompts(2, 99), f"warmup-{name}", output=8)
    probe = BandwidthProbe()
    activation = {name: split_name(name)[0] for name in dtypes}
    # Sampled again each round, as the bandwidths are, and the best so far divides: a peak taken
    # once, at a slow moment of a shared host, would put a later fast run above it.
    peaks = dict.fromkeys(set(activation.values()), 0.0)
    print(f"torch threads {torch.get_num_threads()}")
    best_rate = dict.fromkeys(engines, 0.0)
    for round_ in range(args.rounds):
        triad, read = probe.sample()
        for n in peaks:
            peaks[n] = max(peaks[n], matmul_peak(getattr(torch, n)))
        print(f"round {round_}: triad {triad / 1e9:.1f} GB/s, read {read / 1e9:.1f} GB/s; matmul peak "
              + ", ".join(f"{n} {p / 1e9:.0f} GFLOP/s" for n, p in peaks.items()), flush=True)  # fmt: skip
        for name, core in engines.items():
            dtype = getattr(torch, activation[name])
            quantized = split_name(name)[1]
            if not args.skip_batch1:
                _, decode_s, produced = run(
                    core, prompts(1, round_), f"b1-{name}-{round_}", args.output
                )
                rate = (produced - 1) / decode_s
                best_rate[name] = max(best_rate[name], rate)
                print(f"batch 1  {name:14} {rate:7.1f} tok/s  "
                      + decode_roofline(rate, decode_bytes(dtype, args.output, quantized), triad), flush=True)  # fmt: skip
            if args.skip_batched:
                continue
            first_s, rest_s, produced = run(
                core, prompts(BATCH, 100 + round_), f"bn-{name}-{round_}", args.output
            )
            total = first_s + rest_s
            flops = workload_flops(BATCH, PROMPT, produced) / total
            print(f"batch {BATCH} {name:14} {produced / total:7.1f} out tok/s  "
                  + batched_roofline(flops, peaks[activation[name]]), flush=True)  # fmt: skip
            print("  " + phase_line(first_s, rest_s, produced), flush=True)
    triad, read = probe.sample()
    print(f"after the rounds: triad {triad / 1e9:.1f} GB/s, read {read / 1e9:.1f} GB/s")
    print(
        f"best of the run: triad {probe.triad / 1e9:.1f} GB/s (the roofline), "
        f"read {probe.read / 1e9:.1f} GB/s; matmul peak "
        + ", ".join(f"{n} {p / 1e9:.0f} GFLOP/s" for n, p in peaks.items())
    )
    for name, rate in best_rate.items() if not args.skip_batch1 else ():
        dtype = getattr(torch, activation[name])
        bytes_ = decode_bytes(dtype, args.output, split_name(name)[1])
        print(f"batch 1  {name:14} best {rate:7.1f} tok/s  "
              + decode_roofline(rate, bytes_, probe.triad, probe.read))  # fmt: skip
    for name, core in engines.items() if args.split else ():
        dtype, quantized = split_name(name)
        if quantized:
            print(f"split: {name} skipped (the weight bytes counted here are the dtype's)")
            continue
        weights = linear_params(with_head=False), QWEN_05B["vocab_size"] * QWEN_05B["hidden_size"]
        for batch in [1] * (not args.skip_batch1) + [BATCH] * (not args.skip_batched):
            lines = split_decode_steps(
                core, prompts(batch, 7), args.output, *weights, getattr(torch, dtype).itemsize
            )
            print(f"{name}:", *lines, sep="\n")


if __name__ == "__main__":
    main()
