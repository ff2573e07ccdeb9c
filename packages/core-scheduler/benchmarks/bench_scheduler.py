"""Cost of one scheduler step with many running decode requests.

Times ``Scheduler.schedule()`` + ``Scheduler.update_from_output()`` per step with 64, 256 and 1024
running decode requests (block size 16, so a sixteenth of them cross a block boundary each step
and get a new block and a newly hashed full block). The model is not run: each step's
``ModelRunnerOutput`` (one token per request) is built outside the timed region. The baseline,
measured in the same run, is a bare Python loop that touches each request once (a dict lookup, a
list append and an attribute update): the floor for any per-request Python scheduler. Times are
this thread's CPU time, so that time the machine gives to other processes is not counted.

Run: python3 packages/core-scheduler/benchmarks/bench_scheduler.py
"""

from __future__ import annotations

import time

from ember_kv_cache import KVCacheManager
from ember_scheduler import ModelRunnerOutput, Request, SamplingParams, Scheduler, SchedulerConfig

BLOCK_SIZE = 16
PROMPT_LEN = 16
BATCHES = (64, 256, 1024)
TIMED_STEPS = 96
REPEATS = 7


def _runner_output(scheduler_output, token: int) -> ModelRunnerOutput:
    req_ids = list(scheduler_output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token] for _ in req_ids],
    )


def _make_scheduler(num_requests: int) -> Scheduler:
    max_len = PROMPT_LEN + TIMED_STEPS * (REPEATS + 1) + 8
    num_blocks = num_requests * (-(-max_len // BLOCK_SIZE)) + 1
    config = SchedulerConfig(
        max_num_seqs=num_requests,
        max_num_batched_tokens=num_requests * PROMPT_LEN,
        max_model_len=max_len,
    )
    scheduler = Scheduler(config, KVCacheManager(num_blocks, BLOCK_SIZE))
    params = SamplingParams(max_tokens=max_len - PROMPT_LEN, ignore_eos=True)
    for i in range(num_requests):
        prompt = [(i * 7 + j) % 30_000 + 1 for j in range(PROMPT_LEN)]
        scheduler.add_request(Request(f"req-{i}", prompt, params, eos_token_id=0))
    prefill = scheduler.schedule()  # every prompt in one step
    scheduler.update_from_output(prefill, _runner_output(prefill, 5))
    assert len(scheduler.running) == num_requests
    return scheduler


def _time_scheduler(scheduler: Scheduler) -> float:
    """Seconds per step, schedule() + update_from_output(), the model output prebuilt."""
    total = 0.0
    for step in range(TIMED_STEPS):
        start = time.thread_time()
        scheduler_output = scheduler.schedule()
        total += time.thread_time() - start
        runner_output = _runner_output(scheduler_output, 7 + step % 100)
        start = time.thread_time()
        scheduler.update_from_output(scheduler_output, runner_output)
        total += time.thread_time() - start
        assert len(scheduler_output.num_scheduled_tokens) == len(scheduler.running)
    return total / TIMED_STEPS


def _time_baseline(scheduler: Scheduler) -> float:
    """Seconds per step of a bare loop touching each running request once."""
    running = scheduler.running
    start = time.thread_time()
    for _ in range(TIMED_STEPS):
        scheduled = {}
        ids = []
        for request in running:
            scheduled[request.request_id] = 1
            ids.append(request.request_id)
            request.num_preemptions += 0
    return (time.thread_time() - start) / TIMED_STEPS


def main() -> None:
    print(
        f"scheduler step cost, {TIMED_STEPS} decode steps x {REPEATS} rounds (best round), "
        f"block size {BLOCK_SIZE}"
    )
    schedulers = {n: _make_scheduler(n) for n in BATCHES}
    step_times = {n: [] for n in BATCHES}
    base_times = {n: [] for n in BATCHES}
    # Rounds interleave the batch sizes so that load from other processes hits them alike.
    for _ in range(REPEATS):
        for n, scheduler in schedulers.items():
            step_times[n].append(_time_scheduler(scheduler))
            base_times[n].append(_time_baseline(scheduler))
    print(
        f"{'requests':>9} {'us/step':>10} {'us/request':>11} {'baseline us/req':>16} {'x baseline':>11}"
    )
    per_request = {}
    for n in BATCHES:
        step, base = min(step_times[n]), min(base_times[n])
        per_request[n] = step / n
        print(
            f"{n:>9} {step * 1e6:>10.1f} {step / n * 1e6:>11.2f} "
            f"{base / n * 1e6:>16.3f} {step / base:>11.1f}"
        )
    smallest, largest = BATCHES[0], BATCHES[-1]
    print(
        f"per-request cost at {largest} vs {smallest} requests: "
        f"{per_request[largest] / per_request[smallest]:.2f}x (flat is 1.0)"
    )


if __name__ == "__main__":
    main()
