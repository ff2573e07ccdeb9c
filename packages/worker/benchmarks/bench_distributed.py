"""Per-step communication overhead of tensor (TP=2) and pipeline (PP=2) parallelism vs TP=1.

Runs the ~30M float32 Llama of ``bench_throughput`` (9 layers, hidden 512) through EngineCore
with 16 requests of 64-token prompts and times each decode step's ``execute_model`` for the
in-process executor (TP=1) and the multiprocess executor at TP=2 and PP=2, one torch thread per
rank. The communication is then split into its three parts, each measured with the real code
path or the step's real shapes:

- broadcast: the multiprocess executor's round trip for a step with no tokens (the
  SchedulerOutput goes out to every rank over ZMQ, the output rank's ModelRunnerOutput comes
  back; no collective runs);
- all-reduce: per TP=2 decode step, two all-reduces of ``[16, 512]`` per layer plus the
  embedding's, and the LM head's all-gather of ``[16, vocab/2]``, over a 2-rank gloo group;
- send/recv: per PP=2 decode step, the hidden states and residual ``[16, 512]`` from stage 0 to
  stage 1 and the broadcast of the 16 sampled ids back, over the same group.

Ratios are against the TP=1 decode step measured in the same run.

    python3 packages/worker/benchmarks/bench_distributed.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_throughput import BLOCK_SIZE, model_path, workload

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_core import EngineCore
from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.outputs import CachedRequestData, SchedulerOutput
from ember_scheduler.sampling_params import SamplingParams
from ember_testing.tiny_models import BENCH_LLAMA_CONFIG
from ember_worker.distributed.groups import ParallelConfig, free_port
from ember_worker.distributed.worker import WorkerConfig, model_vocab_size
from ember_worker.executor_factory import make_executor

BATCH = 16
PROMPT_LEN = 64


class TimedExecutor:
    """Records the wall time of every ``execute_model`` call of the executor it wraps."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.num_kv_blocks = executor.num_kv_blocks
        self.block_size = executor.block_size
        self.vocab_size = executor.vocab_size
        self.grammar_compiler = executor.grammar_compiler
        self.seconds: list[float] = []

    def execute_model(self, scheduler_output):
        start = time.perf_counter()
        output = self.executor.execute_model(scheduler_output)
        self.seconds.append(time.perf_counter() - start)
        return output

    def shutdown(self) -> None:
        self.executor.shutdown()


def decode_step_seconds(parallel: ParallelConfig, decode_steps: int) -> tuple[float, float]:
    """(median decode-step seconds, median empty-step round trip seconds) for ``parallel``."""
    config = WorkerConfig(
        str(model_path()),
        dtype="float32",
        max_model_len=PROMPT_LEN + decode_steps + 8,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * PROMPT_LEN,
        block_size=BLOCK_SIZE,
        kv_cache_memory=64 * 1024**2,
        num_threads=1,
        parallel=parallel,
    )
    executor = TimedExecutor(make_executor(config))
    scheduler_config = SchedulerConfig(
        max_num_seqs=BATCH,
        max_num_batched_tokens=BATCH * PROMPT_LEN,
        max_model_len=config.max_model_len,
    )
    core = EngineCore(executor, scheduler_config, executor.grammar_compiler)
    prompts, _ = workload("fixed", BATCH)
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(str(i), prompt, params))
    while core.has_unfinished_requests():
        core.step()
    decode = statistics.median(executor.seconds[1:])  # the first step is the prefill
    executor.seconds.clear()
    empty = SchedulerOutput([], CachedRequestData(), {}, 0)
    for _ in range(decode_steps):
        executor.execute_model(empty)
    round_trip = statistics.median(executor.seconds)
    core.shutdown()
    return decode, round_trip


def _collectives(rank: int, port: int, repeats: int, vocab_size: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    hidden = BENCH_LLAMA_CONFIG["hidden_size"]
    layers = BENCH_LLAMA_CONFIG["num_hidden_layers"]
    x = torch.randn(BATCH, hidden)
    logits = torch.randn(BATCH, vocab_size // 2)
    ids = torch.zeros(BATCH, dtype=torch.int64)

    def tp_step() -> None:
        for _ in range(2 * layers + 1):
            dist.all_reduce(x)
        dist.all_gather([torch.empty_like(logits) for _ in range(2)], logits)

    def pp_step() -> None:
        for _ in range(2):  # hidden states and residual
            dist.send(x, 1) if rank == 0 else dist.recv(x, 0)
        dist.broadcast(ids, 1)

    for name, step in (("all_reduce", tp_step), ("send_recv", pp_step)):
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        if rank == 0:
            results[name] = statistics.median(times)
    dist.destroy_process_group()


def collective_seconds(repeats: int) -> dict[str, float]:
    with mp.Manager() as manager:
        results = manager.dict()
        vocab_size = model_vocab_size(str(model_path()))
        args = (free_port("127.0.0.1"), repeats, vocab_size, results)
        mp.spawn(_collectives, args=args, nprocs=2)
        return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decode-steps", type=int, default=48)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = {}
    for name, parallel in (
        ("TP=1", ParallelConfig()),
        ("TP=2", ParallelConfig(tensor_parallel_size=2)),
        ("PP=2", ParallelConfig(pipeline_parallel_size=2)),
    ):
        rows[name] = decode_step_seconds(parallel, args.decode_steps)
    comm = collective_seconds(args.decode_steps)
    base = rows["TP=1"][0]
    print(
        f"decode step, batch {BATCH}, 30M llama, 1 torch thread per rank (median ms; ratio vs TP=1)"
    )
    for name, (step, _) in rows.items():
        print(f"  {name}: {step * 1e3:7.2f} ms  x{step / base:.2f}")
    print("communication per decode step (median ms; share of the TP=1 step)")
    parts = (
        ("broadcast + result (mp executor, TP=2)", rows["TP=2"][1]),
        ("broadcast + result (mp executor, PP=2)", rows["PP=2"][1]),
        ("all-reduce + LM-head all-gather (TP=2)", comm["all_reduce"]),
        ("send/recv + sampled-id broadcast (PP=2)", comm["send_recv"]),
    )
    for label, seconds in parts:
        print(f"  {label}: {seconds * 1e3:6.3f} ms  ({seconds / base:.1%})")
    print(f"  in-process executor (TP=1) empty step: {rows['TP=1'][1] * 1e3:6.3f} ms")


if __name__ == "__main__":
    main()
