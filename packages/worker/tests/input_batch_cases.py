"""The persistent batch's test helpers: requests, batches, one step's inputs, poisoned padding
and a row's view (test_input_batch*.py)."""

from __future__ import annotations

import numpy as np

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import InputBatch
from ember_worker.model_inputs import ModelInputBuffers, ModelInputs

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
