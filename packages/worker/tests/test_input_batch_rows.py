"""The persistent batch's rows: moves that copy only the valid prefix, padding never read,
chunked prefill and speculative rows, bad input, interleaved KV groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from input_batch_cases import (
    BLOCK,
    POISON_BLOCK,
    POISON_TOKEN,
    VOCAB,
    check_against,
    make_batch,
    new_req,
    poison_padding,
    prepare,
    row_view,
)

from ember_worker.input_batch import InputBatch
from ember_worker.sampling_metadata import build_sampling_metadata


def test_condense_moves_a_full_length_row_into_a_hole():
    max_len = 16
    batch = make_batch(max_num_reqs=4, max_model_len=max_len)
    batch.add_request(new_req("short", [7, 8, 9]))
    batch.add_request(new_req("gone", [1]))
    batch.add_request(new_req("full", list(range(max_len))))
    batch.remove_request("gone")
    model = {r: row_view(batch, r) for r in ("full", "short")}
    poison_padding(batch)
    batch.condense()
    assert batch.req_ids == ["short", "full"]
    check_against(batch, model)


def test_moves_copy_only_the_valid_prefix():
    batch = make_batch(max_num_reqs=4, max_model_len=64)
    batch.add_request(new_req("a", list(range(1, 11))))
    batch.add_request(new_req("b", [5, 6, 7]))
    batch.add_request(new_req("c", list(range(20, 40))))
    batch.remove_request("a")
    poison_padding(batch)
    batch.condense()  # "c" moves from row 2 to row 0
    assert batch.req_ids == ["c", "b"]
    assert batch.token_ids_cpu[0, :20].tolist() == list(range(20, 40))
    assert (batch.token_ids_cpu[0, 20:] == POISON_TOKEN).all()
    assert (batch.block_table_cpu[0, 5:] == POISON_BLOCK).all()


def test_padding_is_never_read():
    batch = make_batch(max_num_reqs=4, max_model_len=64)
    batch.add_request(
        new_req("a", [3, 1, 4, 1, 5], [9, 2], presence_penalty=0.5, temperature=0.7, logprobs=1)
    )
    batch.add_request(new_req("b", [2, 7], computed=1, repetition_penalty=1.3))
    num_sched = np.array([7, 1], dtype=np.int32)

    def snapshot():
        inputs = prepare(batch, num_sched)
        meta = build_sampling_metadata(batch)
        valid_blocks = [inputs.block_table[i, : batch.num_blocks[i]].tolist() for i in range(2)]
        return (
            [t.clone() for t in (inputs.input_ids, inputs.positions, inputs.slot_mapping)],
            valid_blocks,
            meta.output_token_counts.clone(),
            meta.prompt_token_mask.clone(),
        )

    clean = snapshot()
    poison_padding(batch)
    poisoned = snapshot()
    for a, b in zip(clean[0], poisoned[0]):
        assert torch.equal(a, b)
    assert clean[1] == poisoned[1]
    assert torch.equal(clean[2], poisoned[2]) and torch.equal(clean[3], poisoned[3])


def test_chunked_prefill_rows_get_no_sampled_token():
    batch = make_batch()
    batch.add_request(new_req("prefill", list(range(10))))
    batch.add_request(new_req("decode", [1, 2, 3], computed=2))
    batch.add_request(new_req("idle", [4, 5], computed=1))
    prepare(batch, np.array([4, 1, 0], dtype=np.int32))
    assert batch.append_sampled_tokens(np.array([11, 12, 13])) == [[], [12], []]
    assert batch.num_tokens[:3].tolist() == [10, 4, 2]
    assert batch.token_ids_cpu[1, :4].tolist() == [1, 2, 3, 12]


def test_spec_tokens_count_in_the_prefix_and_are_dropped_after_the_step():
    batch = make_batch()
    batch.add_request(new_req("x", [1, 2, 3], blocks=[0, 1]))
    batch.add_request(new_req("y", [4, 5], blocks=[2]))
    # Prefill; x samples 9 and then proposes drafts 7, 8.
    prepare(batch, np.array([3, 2], dtype=np.int32))
    batch.append_sampled_tokens([[9], [6]])
    batch.set_num_computed_tokens("x", 3)
    batch.set_num_computed_tokens("y", 2)
    inputs = prepare(batch, np.array([3, 1], dtype=np.int32), {"x": [7, 8]})
    assert inputs.input_ids.tolist() == [9, 7, 8, 6]
    assert inputs.positions.tolist() == [3, 4, 5, 2]
    assert batch.num_tokens[0] == 6 and batch.num_tokens_no_spec[0] == 4
    assert batch.token_ids_cpu[0, :6].tolist() == [1, 2, 3, 9, 7, 8]
    assert batch.append_sampled_tokens([[7, 10], [11]]) == [[7, 10], [11]]
    assert batch.token_ids_cpu[0, :6].tolist() == [1, 2, 3, 9, 7, 10]
    assert batch.num_tokens[:2].tolist() == [6, 4]


def test_a_top_k_beyond_the_vocabulary_is_stored_as_the_vocabulary():
    batch = make_batch()
    batch.add_request(new_req("a", [1], top_k=2**31 - 1))  # the largest SamplingParams takes
    assert batch.rows[0]["top_k"] == VOCAB


def test_rejected_drafts_leave_the_row_as_it_was():
    batch = make_batch()
    batch.add_request(new_req("x", [1, 2, 3], blocks=[0]))  # one block: room for 4 tokens
    batch.set_num_computed_tokens("x", 2)
    with pytest.raises(ValueError, match="block_ids"):
        prepare(batch, np.array([4], dtype=np.int32), {"x": [7, 8, 9]})
    assert batch.num_tokens[0] == batch.num_tokens_no_spec[0] == 3
    inputs = prepare(batch, np.array([2], dtype=np.int32), {"x": [7]})
    assert inputs.input_ids.tolist() == [3, 7]


def test_bad_input_is_rejected_without_changing_state():
    batch = make_batch(max_num_reqs=2, max_model_len=8)
    batch.add_request(new_req("a", [1, 2]))
    before = (batch.rows.copy(), batch.token_ids_cpu.copy(), dict(batch.req_id_to_index))
    bad = [
        (new_req("a", [1]), "already"),
        (new_req("b", list(range(9))), "max_model_len"),
        (new_req("b", [1], blocks=[0] * 3), "block_ids"),
        (new_req("b", [1], computed=2), "num_computed_tokens"),
    ]
    for req, match in bad:
        with pytest.raises(ValueError, match=match):
            batch.add_request(req)
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        prepare(batch, np.array([3], dtype=np.int32))
    with pytest.raises(ValueError, match="shape"):
        prepare(batch, np.array([1, 1], dtype=np.int32))
    with pytest.raises(ValueError, match="block_ids"):
        batch.append_block_ids("a", [1, 2])
    with pytest.raises(ValueError, match="not in the batch"):
        batch.set_num_computed_tokens("zzz", 0)
    assert (batch.rows == before[0]).all()
    assert (batch.token_ids_cpu == before[1]).all()
    assert batch.req_id_to_index == before[2]


def test_interleaved_kv_groups_give_each_group_its_slots_and_table():
    """Two KV groups share a row: group g's block of token block i at entry i * 2 + g."""
    batch = InputBatch(4, 32, 64, BLOCK, VOCAB, num_kv_groups=2)
    assert batch.max_blocks_per_req == 2 * 8
    # 6 tokens: token blocks 0 and 1; group 0 holds 10, 11 and group 1 holds 20, 21.
    batch.add_request(new_req("a", range(1, 7), blocks=[10, 20, 11, 21]))
    batch.add_request(new_req("b", range(1, 4), blocks=[30, 40]))
    inputs = prepare(batch, np.array([6, 3], dtype=np.int32))
    positions = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2])
    (slots0, table0), (slots1, table1) = inputs.group_tables
    blocks0 = np.array([10] * 4 + [11] * 2 + [30] * 3)
    blocks1 = np.array([20] * 4 + [21] * 2 + [40] * 3)
    assert slots0.tolist() == (blocks0 * BLOCK + positions % BLOCK).tolist()
    assert slots1.tolist() == (blocks1 * BLOCK + positions % BLOCK).tolist()
    assert inputs.slot_mapping.tolist() == slots0.tolist()
    assert table0[:, :2].tolist() == [[10, 11], [30, 0]]
    assert table1[:, :2].tolist() == [[20, 21], [40, 0]]
    # A row of 2 entries holds one token block of each group: 4 tokens, not 6.
    short = InputBatch(4, 32, 64, BLOCK, VOCAB, num_kv_groups=2)
    short.add_request(new_req("c", range(1, 11), blocks=[50, 60]))
    with pytest.raises(ValueError, match="2 blocks cannot hold 6 tokens"):
        short.set_num_scheduled_tokens(np.array([6], dtype=np.int32))
    short.append_block_ids("c", [51, 61])
    (_, table0), (_, table1) = prepare(short, np.array([6], dtype=np.int32)).group_tables
    assert table0[0, :2].tolist() == [50, 51] and table1[0, :2].tolist() == [60, 61]
    single = make_batch()
    single.add_request(new_req("d", [1, 2]))
    assert prepare(single, np.array([2], dtype=np.int32)).group_tables is None
