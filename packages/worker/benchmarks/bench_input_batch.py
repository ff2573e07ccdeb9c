"""Swap and condense of the persistent input batch, against copying whole rows.

For max_model_len 32768 and 131072, with rows of 500 and 800 tokens, times:
- ``swap_rows`` of a 500-token and an 800-token row;
- ``remove_request`` + ``condense`` (the last row moves into the hole);
- the baseline: the same swap copying whole ``max_model_len`` token rows, whole block-table
  rows and each side array one by one.
Prints microseconds per operation (best of several repeats) and ratios measured in this run:
ours against the baseline, and ours at 131072 against ours at 32768 (should stay near 1).

Also times ``prepare_inputs`` (input ids, positions, slot mapping, query offsets, logits indices)
for a decode step of 64 requests and a prefill step of 4 × 512 tokens, against a Python loop over
the tokens building the same arrays.

Run: python3 packages/worker/benchmarks/bench_input_batch.py
"""

from __future__ import annotations

import time

import numpy as np

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import InputBatch

MAX_NUM_REQS = 64
BLOCK_SIZE = 16
VOCAB = 32000
LENGTHS = (500, 800)
REPEATS = 7
CALLS = 2000


def request(req_id: str, num_tokens: int, seed: int) -> NewRequestData:
    rng = np.random.default_rng(seed)
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=rng.integers(0, VOCAB, num_tokens).tolist(),
        output_token_ids=[],
        sampling_params=SamplingParams(temperature=0.8, top_p=0.9, seed=seed, logprobs=2),
        block_ids=rng.integers(0, 100_000, -(-num_tokens // BLOCK_SIZE)).tolist(),
        num_computed_tokens=0,
    )


def filled_batch(max_model_len: int) -> InputBatch:
    batch = InputBatch(MAX_NUM_REQS, max_model_len, 8192, BLOCK_SIZE, VOCAB)
    for i in range(MAX_NUM_REQS):
        batch.add_request(request(f"r{i}", LENGTHS[i % 2], i))
    return batch


def full_row_swap(batch: InputBatch, i: int, j: int) -> None:
    """What a batch without per-row lengths must do: move whole rows, field by field."""
    for array in (batch.token_ids_cpu, batch.block_table_cpu):
        array[[i, j]] = array[[j, i]]
    for name in batch.rows.dtype.names:
        field = batch.rows[name]
        field[i], field[j] = field[j], field[i]


def once_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def best_us(fn, calls: int = CALLS) -> float:
    return min(once_us(fn, calls) for _ in range(REPEATS))


def condense_once_us(batch: InputBatch) -> float:
    """remove_request of a middle row + condense (moves the last row), re-adding it untimed."""
    elapsed = 0.0
    calls = CALLS // 4
    for k in range(calls):
        victim = batch.req_ids[5]
        start = time.perf_counter()
        batch.remove_request(victim)
        batch.condense()
        elapsed += time.perf_counter() - start
        batch.add_request(request(victim, LENGTHS[k % 2], k))
    return elapsed / calls * 1e6


def loop_prepare(batch: InputBatch, num_scheduled: np.ndarray, out: dict) -> None:
    """The per-token Python loop that vectorized preparation replaces, into the same kind of
    preallocated numpy buffers."""
    input_ids, positions, slots = out["input_ids"], out["positions"], out["slot_mapping"]
    query_start, seq_lens, logits_indices = out["query_start"], out["seq_lens"], out["logits"]
    tokens, blocks, computed = batch.token_ids_cpu, batch.block_table_cpu, batch.num_computed_tokens
    i = 0
    for row, count in enumerate(num_scheduled.tolist()):
        start = int(computed[row])
        for pos in range(start, start + count):
            input_ids[i] = tokens[row, pos]
            positions[i] = pos
            slots[i] = blocks[row, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            i += 1
        query_start[row + 1] = i
        seq_lens[row] = start + count
        logits_indices[row] = i - 1


def prepare_results() -> dict[str, tuple[float, float]]:
    results = {}
    for name, num_reqs, length, computed in (
        ("decode 64 x 1", 64, 800, 799),
        ("prefill 4 x 512", 4, 512, 0),
    ):
        batch = InputBatch(64, 32768, 8192, BLOCK_SIZE, VOCAB)
        for i in range(num_reqs):
            req = request(f"r{i}", length, i)
            req.num_computed_tokens = computed
            batch.add_request(req)
        num_scheduled = np.full(num_reqs, length - computed, dtype=np.int32)
        ours = batch.prepare_inputs(num_scheduled)
        out = {
            name: np.zeros(8192, dtype=np.int64)
            for name in (
                "input_ids",
                "positions",
                "slot_mapping",
                "query_start",
                "seq_lens",
                "logits",
            )
        }
        loop_prepare(batch, num_scheduled, out)
        total = ours.num_tokens
        assert ours.slot_mapping.tolist() == out["slot_mapping"][:total].tolist(), "disagreement"
        assert ours.input_ids.tolist() == out["input_ids"][:total].tolist(), "disagreement"
        results[name] = (
            best_us(lambda b=batch, s=num_scheduled: b.prepare_inputs(s), calls=200),
            best_us(lambda b=batch, s=num_scheduled, o=out: loop_prepare(b, s, o), calls=5),
        )
    return results


def main() -> None:
    batches = {max_model_len: filled_batch(max_model_len) for max_model_len in (32768, 131072)}
    # Rounds interleave every measurement, so that load on a shared machine hits all alike;
    # each figure is its best round. Rows 2 (500 tokens) and 5 (800 tokens) are swapped.
    results = {m: [float("inf")] * 3 for m in batches}
    for _ in range(REPEATS):
        for max_model_len, batch in batches.items():
            best = results[max_model_len]
            best[0] = min(best[0], once_us(lambda b=batch: b.swap_rows(2, 5), CALLS))
            best[1] = min(best[1], condense_once_us(batch))
            full = once_us(lambda b=batch: full_row_swap(b, 2, 5), CALLS // 10)
            best[2] = min(best[2], full)
    print(f"rows of {LENGTHS[0]} and {LENGTHS[1]} tokens, {MAX_NUM_REQS} rows, block {BLOCK_SIZE}")
    print(
        f"{'max_model_len':>14} {'swap us':>9} {'remove+condense us':>19} {'full-row swap us':>17}"
    )
    for max_model_len, (swap, condense, full) in results.items():
        print(f"{max_model_len:>14} {swap:>9.2f} {condense:>19.2f} {full:>17.2f}")
    for max_model_len, (swap, _, full) in results.items():
        print(f"swap / full-row swap at {max_model_len}: {swap / full:.4f}")
    (s32, c32, _), (s128, c128, _) = results[32768], results[131072]
    print(f"swap at 131072 / swap at 32768: {s128 / s32:.2f}")
    print(f"remove+condense at 131072 / at 32768: {c128 / c32:.2f}")
    print()
    print(f"{'prepare_inputs':>16} {'ours us':>9} {'token loop us':>14} {'ratio':>7}")
    for name, (ours, loop) in prepare_results().items():
        print(f"{name:>16} {ours:>9.1f} {loop:>14.1f} {ours / loop:>7.4f}")


if __name__ == "__main__":
    main()
