"""InputBatch and ModelInputBuffers: row operations against a plain-Python model, input
preparation against a per-token reference, min_tokens masks through moves (the rows' own cases:
test_input_batch_rows.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from input_batch_cases import (
    BLOCK,
    VOCAB,
    check_against,
    make_batch,
    new_req,
    poison_padding,
    prepare,
    row_view,
)

from ember_worker.input_batch import InputBatch


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
