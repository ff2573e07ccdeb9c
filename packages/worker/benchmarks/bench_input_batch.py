"""What the model runner does to the persistent batch each step, against vLLM v1's way of it.

- ``remove_request`` + ``condense`` (the last row moves into the hole), for max_model_len 32768
  and 131072 with rows of 500 and 800 tokens. Baseline: vLLM v1's ``InputBatch.condense`` shape,
  written here: the token prefix and the block-table prefix are copied as ours are, and each side
  field lives in its own array and is copied one by one (ours moves one record of all of them).
- Step-input preparation (``set_num_scheduled_tokens`` + ``ModelInputBuffers.prepare``: input
  ids, positions, slot mapping, query offsets, sequence lengths, logits indices) for a decode step
  of 64 requests, a prefill of 4 × 512 tokens and a mixed step. Baseline: vLLM v1's
  ``gpu_model_runner._prepare_inputs`` numpy code (repeat the row index, cumsum offsets, gather
  tokens through a flat index, slot = block number × block size + offset), written here into
  preallocated buffers of the same kind.

Prints microseconds per operation (best of many short rounds, which interleave every measurement
so that load on a shared machine hits all alike) and ratios measured in this run (ours / baseline; below 1 is
faster), plus ours at 131072 against ours at 32768 (should stay near 1).

Run: python3 packages/worker/benchmarks/bench_input_batch.py
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import ROW_STATE_DTYPE, InputBatch
from ember_worker.model_inputs import ModelInputBuffers

MAX_NUM_REQS = 64
MAX_NUM_BATCHED_TOKENS = 8192
BLOCK_SIZE = 16
VOCAB = 32000
LENGTHS = (500, 800)
# Many short rounds: on a loaded machine the best of many short runs is the stable figure.
ROUNDS = 40
CALLS = 50


def request(req_id: str, num_tokens: int, seed: int, computed: int = 0) -> NewRequestData:
    rng = np.random.default_rng(seed)
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=rng.integers(0, VOCAB, num_tokens).tolist(),
        output_token_ids=[],
        sampling_params=SamplingParams(temperature=0.8, top_p=0.9, seed=seed, logprobs=2),
        block_ids=rng.integers(0, 100_000, -(-num_tokens // BLOCK_SIZE)).tolist(),
        num_computed_tokens=computed,
    )


# The per-row fields of the vLLM-shaped batch: num_tokens and num_blocks first, then the rest of
# what a row of ours carries.
FIELDS = ["num_tokens", "num_blocks"] + [
    name for name in ROW_STATE_DTYPE.names if name not in ("num_tokens", "num_blocks")
]


class FieldArraysBatch:
    """vLLM v1's InputBatch layout for removal and condensing: token ids and block table as 2-D
    arrays, every other per-row field in an array of its own."""

    def __init__(self, max_model_len: int) -> None:
        self.token_ids = np.zeros((MAX_NUM_REQS, max_model_len), dtype=np.int32)
        self.block_table = np.zeros((MAX_NUM_REQS, -(-max_model_len // BLOCK_SIZE)), np.int32)
        self.fields = [np.zeros(MAX_NUM_REQS, dtype=ROW_STATE_DTYPE[name]) for name in FIELDS]
        self.num_tokens, self.num_blocks = self.fields[0], self.fields[1]
        self.req_ids: list[str | None] = []
        self.index: dict[str, int] = {}

    def add(self, req: NewRequestData) -> None:
        row = len(self.req_ids)
        n, b = len(req.prompt_token_ids), len(req.block_ids)
        self.token_ids[row, :n] = req.prompt_token_ids
        self.block_table[row, :b] = req.block_ids
        self.num_tokens[row], self.num_blocks[row] = n, b
        self.req_ids.append(req.req_id)
        self.index[req.req_id] = row

    def remove(self, req_id: str) -> int:
        row = self.index.pop(req_id)
        self.req_ids[row] = None
        return row

    def condense(self, empty_rows: list[int]) -> None:
        """Move the last live row into each hole, lowest hole first (vLLM's condense)."""
        last = len(self.req_ids) - 1
        for empty in sorted(empty_rows):
            while last > empty and self.req_ids[last] is None:
                last -= 1
            if last <= empty:
                break
            n, b = self.num_tokens[last], self.num_blocks[last]
            self.token_ids[empty, :n] = self.token_ids[last, :n]
            self.block_table[empty, :b] = self.block_table[last, :b]
            for field in self.fields:
                field[empty] = field[last]
            req_id = self.req_ids[last]
            self.req_ids[empty] = req_id
            self.req_ids[last] = None
            self.index[req_id] = empty
            last -= 1
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()


def time_remove_condense(remove_condense, add, calls: int) -> float:
    """Microseconds per removal of a middle row + condense; the row is re-added untimed."""
    elapsed = 0.0
    for k in range(calls):
        start = time.perf_counter()
        victim = remove_condense()
        elapsed += time.perf_counter() - start
        add(request(victim, LENGTHS[k % 2], k))
    return elapsed / calls * 1e6


def ours_remove_condense(batch: InputBatch):
    def step() -> str:
        victim = batch.req_ids[5]
        batch.remove_request(victim)
        batch.condense()
        return victim

    return step, batch.add_request


def baseline_remove_condense(batch: FieldArraysBatch):
    def step() -> str:
        victim = batch.req_ids[5]
        batch.condense([batch.remove(victim)])
        return victim

    return step, batch.add


def filled(batch, add):
    for i in range(MAX_NUM_REQS):
        add(request(f"r{i}", LENGTHS[i % 2], i))
    return batch


class NumpyPrepare:
    """vLLM v1's ``_prepare_inputs`` numpy steps, into preallocated buffers."""

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        self.arange = np.arange(MAX_NUM_BATCHED_TOKENS + 1, dtype=np.int64)
        self.input_ids = torch.zeros(MAX_NUM_BATCHED_TOKENS, dtype=torch.int32)  # as vLLM
        self.positions = np.zeros(MAX_NUM_BATCHED_TOKENS, dtype=np.int64)
        self.slot_mapping = np.zeros(MAX_NUM_BATCHED_TOKENS, dtype=np.int64)
        self.query_start_loc = np.zeros(MAX_NUM_REQS + 1, dtype=np.int32)
        self.seq_lens = np.zeros(MAX_NUM_REQS, dtype=np.int32)
        self.token_ids_flat = torch.from_numpy(batch.token_ids_cpu).flatten()

    def __call__(self, num_scheduled: np.ndarray) -> tuple[torch.Tensor, np.ndarray, int]:
        batch = self.batch
        n = len(num_scheduled)
        req_indices = np.repeat(self.arange[:n], num_scheduled)
        cu = np.cumsum(num_scheduled)
        total = int(cu[-1])
        offsets = self.arange[:total] - np.repeat(cu - num_scheduled, num_scheduled)
        positions = self.positions[:total]
        np.add(batch.num_computed_tokens[req_indices], offsets, out=positions)
        token_indices = positions + req_indices * batch.max_model_len
        torch.index_select(
            self.token_ids_flat, 0, torch.from_numpy(token_indices), out=self.input_ids[:total]
        )
        block_indices = req_indices * batch.max_blocks_per_req + positions // BLOCK_SIZE
        block_numbers = batch.block_table_cpu.reshape(-1)[block_indices]
        np.add(block_numbers * BLOCK_SIZE, positions % BLOCK_SIZE, out=self.slot_mapping[:total])
        self.query_start_loc[1 : n + 1] = cu
        self.seq_lens[:n] = batch.num_computed_tokens[:n] + num_scheduled
        logits_indices = torch.from_numpy(self.query_start_loc[1 : n + 1] - 1)
        return self.input_ids[:total], self.slot_mapping[:total], int(logits_indices[-1])


def prepare_cases():
    """(name, batch, num_scheduled): decode, prefill and a mixed step of decodes and chunks."""
    cases = []
    for name, rows in (
        ("decode 64 x 1", [(800, 799, 1)] * 64),
        ("prefill 4 x 512", [(512, 0, 512)] * 4),
        ("mixed 60 x 1 + 4 x 256", [(800, 799, 1)] * 60 + [(1024, 256, 256)] * 4),
    ):
        batch = InputBatch(MAX_NUM_REQS, 32768, MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE, VOCAB)
        for i, (length, computed, _) in enumerate(rows):
            batch.add_request(request(f"r{i}", length, i, computed))
        cases.append((name, batch, np.array([r[2] for r in rows], dtype=np.int32)))
    return cases


def main() -> None:
    condense_cases = {}
    for max_model_len in (32768, 131072):
        ours = InputBatch(MAX_NUM_REQS, max_model_len, MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE, VOCAB)
        base = FieldArraysBatch(max_model_len)
        condense_cases[max_model_len] = (
            ours_remove_condense(filled(ours, ours.add_request)),
            baseline_remove_condense(filled(base, base.add)),
        )
    prepares = []
    for name, batch, num_scheduled in prepare_cases():
        buffers, baseline = ModelInputBuffers(batch), NumpyPrepare(batch)

        def ours(b=batch, s=num_scheduled, buf=buffers):
            b.set_num_scheduled_tokens(s)
            return buf.prepare()

        got, (ids, slots, last) = ours(), baseline(num_scheduled)
        assert got.input_ids.tolist() == ids.tolist(), "disagreement"
        assert got.slot_mapping.tolist() == slots.tolist(), "disagreement"
        assert int(got.logits_indices[-1]) == last, "disagreement"
        prepares.append((name, ours, lambda f=baseline, s=num_scheduled: f(s)))

    condense_us = {m: [float("inf")] * 2 for m in condense_cases}
    prepare_us = {name: [float("inf")] * 2 for name, _, _ in prepares}
    for _ in range(ROUNDS):
        for max_model_len, cases in condense_cases.items():
            for k, (step, add) in enumerate(cases):
                took = time_remove_condense(step, add, CALLS)
                condense_us[max_model_len][k] = min(condense_us[max_model_len][k], took)
        for name, *fns in prepares:
            for k, fn in enumerate(fns):
                start = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                took = (time.perf_counter() - start) / CALLS * 1e6
                prepare_us[name][k] = min(prepare_us[name][k], took)

    print(f"rows of {LENGTHS[0]} and {LENGTHS[1]} tokens, {MAX_NUM_REQS} rows, block {BLOCK_SIZE}")
    print(f"{'remove+condense':>22} {'ours us':>9} {'vLLM-shape us':>14} {'ratio':>7}")
    for max_model_len, (ours_us, base_us) in condense_us.items():
        label = f"max_model_len {max_model_len}"
        print(f"{label:>22} {ours_us:>9.2f} {base_us:>14.2f} {ours_us / base_us:>7.2f}")
    (o32, _), (o128, _) = condense_us[32768], condense_us[131072]
    print(f"ours at 131072 / ours at 32768: {o128 / o32:.2f}")
    print()
    print(f"{'prepare inputs':>22} {'ours us':>9} {'vLLM numpy us':>14} {'ratio':>7}")
    for name, (ours_us, base_us) in prepare_us.items():
        print(f"{name:>22} {ours_us:>9.1f} {base_us:>14.1f} {ours_us / base_us:>7.2f}")


if __name__ == "__main__":
    main()
