"""The persistent batch's per-step updates over many rows at once: computed-token counts (with
the drafts a step in flight counted as accepted) and appended tokens."""

from __future__ import annotations

import numpy as np
import pytest

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import InputBatch


def batch_of(*prompts: list[int]) -> InputBatch:
    batch = InputBatch(4, 32, 64, 4, 100)
    for i, prompt in enumerate(prompts):
        blocks = list(range(-(-len(prompt) // 4) + 1))
        batch.add_request(NewRequestData(f"r{i}", prompt, [], SamplingParams(), blocks, 0))
    return batch


def test_computed_counts_of_many_rows_take_back_rejected_drafts():
    batch = batch_of([1, 2, 3, 4, 5], [6, 7, 8])
    batch.rows["num_accepted_drafts"][:2] = [1, 0]  # the last step accepted 1 and 0 drafts
    batch.set_num_computed_tokens_of(["r1", "r0"], [3, 5], [2, 0])
    # r1: 2 drafts counted as accepted, none was: 2 come off; r0 had none in flight
    assert batch.num_computed_tokens[:2].tolist() == [5, 1]


def test_a_bad_computed_count_changes_no_row():
    batch = batch_of([1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match="num_computed_tokens of 'r1'"):
        batch.set_num_computed_tokens_of(["r0", "r1"], [2, 3])
    with pytest.raises(ValueError, match="not in the batch"):
        batch.set_num_computed_tokens_of(["r0", "zzz"], [1, 1])
    assert batch.num_computed_tokens[:2].tolist() == [0, 0]


def test_one_token_rows_append_where_they_sampled():
    batch = batch_of([1, 2, 3], [4, 5])
    batch.append_token_runs(np.array([[9], [8]]), np.array([0, 1]))
    assert batch.num_tokens_no_spec[:2].tolist() == [3, 3]
    assert batch.token_ids_cpu[1, :3].tolist() == [4, 5, 8]


@pytest.mark.parametrize("counts", [[2, 0], [-1, 1]])
def test_runs_longer_than_their_width_or_negative_are_refused(counts):
    batch = batch_of([1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match="num_tokens"):
        batch.append_token_runs(np.array([[9], [8]]), np.array(counts))
    assert batch.num_tokens_no_spec[:2].tolist() == [3, 2]
