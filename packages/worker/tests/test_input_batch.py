"""InputBatch and ModelInputBuffers: row operations against a plain-Python model, input
preparation, padding safety."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import InputBatch
from ember_worker.model_inputs import ModelInputBuffers, ModelInputs
from ember_worker.sampling_metadata import build_sampling_metadata

BLOCK = 4
VOCAB = 1000
POISON_TOKEN = 2**31 - 1
POISON_BLOCK = -(2**30)


def new_req(req_id, prompt, output=(), blocks=None, computed=0, eos=None, **params):
    num_tokens = len(prompt) + len(output)
    if blocks is None:
        blocks = list(range(100, 100 + -(-num_tokens // BLOCK)))
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        sampling_params=SamplingParams(**params),
        block_ids=list(blocks),
        num_computed_tokens=computed,
        eos_token_id=eos,
    )


def make_batch(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=512):
    return InputBatch(max_num_reqs, max_model_len, max_num_batched_tokens, BLOCK, VOCAB)


def prepare(batch: InputBatch, num_scheduled, drafts=None) -> ModelInputs:
    """One step's inputs, as the model runner takes them: set the counts, then read them."""
    batch.set_num_scheduled_tokens(num_scheduled, drafts)
    return ModelInputBuffers(batch).prepare()


def poison_padding(batch: InputBatch) -> None:
    """Overwrite everything past each row's valid prefix (and every free row)."""
    cols = np.arange(batch.max_model_len)
    batch.token_ids_cpu[cols[None, :] >= batch.num_tokens[:, None]] = POISON_TOKEN
    bcols = np.arange(batch.max_blocks_per_req)
    batch.block_table_cpu[bcols[None, :] >= batch.num_blocks[:, None]] = POISON_BLOCK


def row_view(batch: InputBatch, req_id: str):
    row = batch.req_id_to_index[req_id]
    assert batch.req_ids[row] == req_id
    n, b = batch.num_tokens[row], batch.num_blocks[row]
    return (
        batch.token_ids_cpu[row, :n].tolist(),
        batch.block_table_cpu[row, :b].tolist(),
        int(batch.num_computed_tokens[row]),
        int(batch.num_prompt_tokens[row]),
        float(batch.rows[row]["temperature"]),
    )


def check_against(batch: InputBatch, model: dict) -> None:
    assert batch.num_reqs == len(model)
    assert set(batch.req_id_to_index) == set(model)
    for req_id, expected in model.items():
        assert row_view(batch, req_id) == expected


def random_min_tokens_params(rng: random.Random) -> tuple[dict, set[int]]:
    """Sampling params (min_tokens, stop ids, ignore_eos) plus an eos, and the ids they mask."""
    eos = rng.choice([None, rng.randrange(VOCAB)])
    params = dict(
        eos=eos,
        min_tokens=rng.choice([0, rng.randint(1, 12)]),
        stop_token_ids=[rng.randrange(VOCAB + 5) for _ in range(rng.randint(0, 2))],
        ignore_eos=rng.random() < 0.3,
    )
    ids = {t for t in params["stop_token_ids"] if t < VOCAB}
    if eos is not None and not params["ignore_eos"]:
        ids.add(eos)
    return params, ids


def check_min_tokens_mask(batch: InputBatch, model: dict, masks: dict) -> None:
    """The batch masks (row, id) for exactly the requests below min_tokens, at their rows."""
    expected = set()
    for req_id, (tokens, _, _, num_prompt, _) in model.items():
        min_tokens, ids = masks[req_id]
        if len(tokens) - num_prompt < min_tokens:
            expected |= {(batch.req_id_to_index[req_id], t) for t in ids}
    got = batch.min_tokens_stop_mask()
    assert (got is None) == (not expected)
    if got is not None:
        pairs = list(zip(got[0].tolist(), got[1].tolist()))
        assert len(pairs) == len(set(pairs)) and set(pairs) == expected


def test_add_then_prepare_inputs_matches_reference():
    batch = make_batch()
    rng = np.random.default_rng(0)
    reqs = []
    for i, (length, computed) in enumerate([(5, 0), (17, 8), (1, 0), (30, 29)]):
        prompt = rng.integers(0, VOCAB, length).tolist()
        blocks = rng.permutation(500)[: -(-length // BLOCK)].tolist()
        reqs.append((prompt, blocks, computed))
        batch.add_request(new_req(f"r{i}", prompt, blocks=blocks, computed=computed))
    poison_padding(batch)
    num_sched = np.array([len(p) - c for p, _, c in reqs], dtype=np.int32)
    inputs = prepare(batch, num_sched)

    ids, pos, slots, last = [], [], [], []
    for prompt, blocks, computed in reqs:
        for p in range(computed, len(prompt)):
            ids.append(prompt[p])
            pos.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        last.append(len(ids) - 1)
    assert inputs.input_ids.tolist() == ids
    assert inputs.positions.tolist() == pos
    assert inputs.slot_mapping.dtype == torch.int64
    assert inputs.slot_mapping.tolist() == slots
    assert inputs.query_start_loc.tolist() == [0, *np.cumsum(num_sched).tolist()]
    assert inputs.seq_lens.tolist() == [len(p) for p, _, _ in reqs]
    assert inputs.logits_indices.tolist() == last
    assert inputs.max_query_len == 9 and inputs.max_seq_len == 30
    assert inputs.num_tokens == len(ids)
    for i, (_, blocks, _) in enumerate(reqs):
        assert inputs.block_table[i, : len(blocks)].tolist() == blocks


@st.composite
def schedules(draw):
    """Rows of random length, computed prefix and scheduled count (zeros included)."""
    rows = []
    for _ in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 40))
        computed = draw(st.integers(0, length))
        scheduled = draw(st.integers(0, length - computed))
        rows.append((length, computed, scheduled))
    if sum(r[2] for r in rows) == 0:
        length, computed, _ = rows[0]
        rows[0] = (length, length - 1, 1)
    return rows


@settings(max_examples=60, deadline=None)
@given(schedules(), st.integers(0, 2**31 - 1))
def test_prepare_inputs_matches_a_per_token_reference(rows, seed):
    rng = np.random.default_rng(seed)
    batch = make_batch(max_num_reqs=6, max_model_len=40)
    expected = {"ids": [], "pos": [], "slots": [], "last": [], "qsl": [0]}
    for i, (length, computed, scheduled) in enumerate(rows):
        tokens = rng.integers(0, VOCAB, length).tolist()
        blocks = rng.integers(0, 5000, -(-length // BLOCK)).tolist()
        batch.add_request(new_req(f"r{i}", tokens, blocks=blocks, computed=computed))
        for p in range(computed, computed + scheduled):
            expected["ids"].append(tokens[p])
            expected["pos"].append(p)
            expected["slots"].append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        expected["qsl"].append(expected["qsl"][-1] + scheduled)
        expected["last"].append(max(expected["qsl"][-1] - 1, 0))
    poison_padding(batch)
    inputs = prepare(batch, np.array([r[2] for r in rows], dtype=np.int32))
    assert inputs.input_ids.tolist() == expected["ids"]
    assert inputs.positions.tolist() == expected["pos"]
    assert inputs.slot_mapping.tolist() == expected["slots"]
    assert inputs.query_start_loc.tolist() == expected["qsl"]
    assert inputs.logits_indices.tolist() == expected["last"]
    assert inputs.seq_lens.tolist() == [c + s for _, c, s in rows]
    assert inputs.max_query_len == max(r[2] for r in rows)


def test_remove_leaves_hole_and_condense_moves_last_rows():
    batch = make_batch()
    model = {}
    for i in range(5):
        req = new_req(f"r{i}", list(range(i * 3 + 1)), temperature=0.1 * i)
        batch.add_request(req)
        model[f"r{i}"] = None
    model = {r: row_view(batch, r) for r in model}
    assert batch.remove_request("r1") == 1
    assert batch.remove_request("r3") == 3
    assert batch.remove_request("missing") is None
    del model["r1"], model["r3"]
    assert batch.req_ids == ["r0", None, "r2", None, "r4"]
    with pytest.raises(ValueError, match="condense"):
        prepare(batch, np.ones(3, dtype=np.int32))
    batch.condense()
    assert batch.req_ids == ["r0", "r4", "r2"]
    check_against(batch, model)
    # A new request takes the lowest free row.
    batch.remove_request("r0")
    assert batch.add_request(new_req("r5", [1, 2])) == 0


def test_condense_after_removing_the_tail_only_shrinks():
    batch = make_batch()
    for i in range(3):
        batch.add_request(new_req(f"r{i}", [i + 1]))
    batch.remove_request("r1")
    batch.remove_request("r2")
    batch.condense()
    assert batch.req_ids == ["r0"]
    assert batch.add_request(new_req("r3", [5])) == 1


@pytest.mark.parametrize("seed", range(12))
def test_random_operations_match_a_plain_model(seed):
    """Adds, removes, condenses, appends and step updates, rows of any length (empty
    after removal, full max_model_len, unequal), checked against a dict after every operation
    with all padding poisoned, so a read or copy past a valid prefix would show."""
    rng = random.Random(seed)
    max_len = 32
    batch = make_batch(max_num_reqs=6, max_model_len=max_len)
    model: dict[str, list] = {}
    masks: dict[str, tuple[int, set[int]]] = {}
    next_id = 0
    for _ in range(120):
        poison_padding(batch)
        op = rng.random()
        if op < 0.3 and batch.num_reqs < batch.max_num_reqs:
            length = rng.choice([1, max_len, rng.randint(1, max_len)])
            num_prompt = rng.randint(1, length)
            tokens = [rng.randrange(VOCAB) for _ in range(length)]
            blocks = [rng.randrange(10_000) for _ in range(-(-length // BLOCK))]
            computed = rng.randint(0, length)
            params, masked_ids = random_min_tokens_params(rng)
            masks[f"q{next_id}"] = (params["min_tokens"], masked_ids)
            batch.add_request(
                new_req(
                    f"q{next_id}",
                    tokens[:num_prompt],
                    tokens[num_prompt:],
                    blocks,
                    computed,
                    temperature=rng.random(),
                    **params,
                )
            )
            model[f"q{next_id}"] = row_view(batch, f"q{next_id}")
            assert model[f"q{next_id}"][:4] == (tokens, blocks, computed, num_prompt)
            next_id += 1
        elif op < 0.5 and model:
            victim = rng.choice(sorted(model))
            batch.remove_request(victim)
            del model[victim]
        elif op < 0.85:
            batch.condense()
            assert None not in batch.req_ids
            check_min_tokens_mask(batch, model, masks)
        elif model:
            batch.condense()
            # One step: every request decodes its remaining tokens and samples one more.
            num_sched = np.array(
                [
                    0 if n == max_len else n - c
                    for n, c in zip(batch.num_tokens[: batch.num_reqs], batch.num_computed_tokens)
                ]
            )
            if num_sched.sum() == 0:
                continue
            inputs = prepare(batch, num_sched)
            assert (inputs.input_ids < VOCAB).all() and (inputs.slot_mapping >= 0).all()
            sampled = np.array([rng.randrange(VOCAB) for _ in range(batch.num_reqs)])
            appended = batch.append_sampled_tokens(sampled)
            for row, req_id in enumerate(batch.req_ids):
                tokens, blocks, _, num_prompt, temp = model[req_id]
                if appended[row]:
                    batch.set_num_computed_tokens(req_id, len(tokens))
                    new_blocks = [] if len(tokens) % BLOCK else [rng.randrange(10_000)]
                    batch.append_block_ids(req_id, new_blocks)
                    model[req_id] = (
                        tokens + appended[row],
                        blocks + new_blocks,
                        len(tokens),
                        num_prompt,
                        temp,
                    )
            batch.condense()
            check_min_tokens_mask(batch, model, masks)
        check_against(batch, model)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(["add", "remove", "decode"]), max_size=40), st.randoms())
def test_min_tokens_mask_follows_its_request_through_moves(ops, rng):
    """Rows move (condense after removal) and grow; the mask stays on each request's row
    and ends when that request reaches min_tokens."""
    batch = make_batch(max_num_reqs=5, max_model_len=24)
    model, masks, next_id = {}, {}, 0
    for op in ops:
        if op == "add" and batch.num_reqs < batch.max_num_reqs:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]
            output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))]
            params, masked_ids = random_min_tokens_params(rng)
            masks[f"q{next_id}"] = (params["min_tokens"], masked_ids)
            blocks = list(range(6))  # room for the whole max_model_len
            batch.add_request(new_req(f"q{next_id}", prompt, output, blocks, **params))
            model[f"q{next_id}"] = row_view(batch, f"q{next_id}")
            next_id += 1
        elif op == "remove" and model:
            victim = rng.choice(sorted(model))
            batch.remove_request(victim)
            del model[victim]
        elif op == "decode" and model:
            batch.condense()
            # Requests not at max_model_len receive one token each (as after a decode step).
            sampled = [
                [] if batch.num_tokens[row] == batch.max_model_len else [rng.randrange(VOCAB)]
                for row in range(batch.num_reqs)
            ]
            batch.append_sampled_tokens(sampled)
            for req_id, new_tokens in zip(batch.req_ids, sampled):
                tokens, *rest = model[req_id]
                model[req_id] = (tokens + new_tokens, *rest)
        batch.condense()
        check_against(batch, model)
        check_min_tokens_mask(batch, model, masks)


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
