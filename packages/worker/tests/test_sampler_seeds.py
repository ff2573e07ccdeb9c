"""Seeded sampling: independent of the batch and of preemption, and correctly distributed."""

from __future__ import annotations

import numpy as np
import torch

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import InputBatch
from ember_worker.sampler import Sampler
from ember_worker.sampling_metadata import build_sampling_metadata
from ember_worker.sampling_random import seeded_uniform

VOCAB = 64
MAX_LEN = 64


def logits_for(tokens: list[int]) -> torch.Tensor:
    """A flat-ish distribution that depends on the context, like a model's would."""
    g = torch.Generator().manual_seed(sum(tokens) * 7 + len(tokens))
    return torch.randn(VOCAB, generator=g) * 0.5


def generate(batch: InputBatch, steps: int) -> dict[str, list[int]]:
    """Decode ``steps`` tokens for every row; returns each request's new tokens."""
    out = {req_id: [] for req_id in batch.req_ids}
    for _ in range(steps):
        n = batch.num_reqs
        for row in range(n):
            batch.set_num_computed_tokens(batch.req_ids[row], int(batch.num_tokens[row]) - 1)
        batch.set_num_scheduled_tokens(np.ones(n, dtype=np.int32))
        logits = torch.stack(
            [logits_for(batch.token_ids_cpu[r, : batch.num_tokens[r]].tolist()) for r in range(n)]
        )
        sampled = Sampler()(logits, build_sampling_metadata(batch)).sampled_token_ids.numpy()
        for req_id, tokens in zip(batch.req_ids, batch.append_sampled_tokens(sampled)):
            out[req_id] += tokens
    return out


def add(batch, req_id, prompt, output=(), **params):
    batch.add_request(
        NewRequestData(req_id, list(prompt), list(output), SamplingParams(**params), [0] * 16, 0)
    )


def test_seeded_request_is_the_same_alone_in_a_batch_and_twice():
    alone = InputBatch(1, MAX_LEN, 64, 4, VOCAB)
    add(alone, "s", [1, 2, 3], seed=42, temperature=1.0, top_p=0.95)
    first = generate(alone, 12)["s"]

    crowded = InputBatch(5, MAX_LEN, 64, 4, VOCAB)
    add(crowded, "u0", [9, 9], temperature=1.0)
    add(crowded, "g", [4], temperature=0.0)
    add(crowded, "s", [1, 2, 3], seed=42, temperature=1.0, top_p=0.95)
    add(crowded, "o", [5, 6], seed=7, temperature=0.8)
    torch.manual_seed(123)  # the unseeded rows' generator state must not matter
    assert generate(crowded, 12)["s"] == first

    again = InputBatch(3, MAX_LEN, 64, 4, VOCAB)
    add(again, "gone", [5], temperature=1.0)
    add(again, "x", [8], seed=3, temperature=1.0)
    add(again, "s", [1, 2, 3], seed=42, temperature=1.0, top_p=0.95)
    again.remove_request("gone")
    again.condense()  # "s" moves from row 2 to row 0
    assert generate(again, 12)["s"] == first
    assert len(set(first)) > 3  # it does sample, not repeat one token


def test_seeded_request_resumes_identically_after_preemption():
    whole = InputBatch(1, MAX_LEN, 64, 4, VOCAB)
    add(whole, "s", [1, 2, 3], seed=5, temperature=1.0)
    expected = generate(whole, 10)["s"]

    batch = InputBatch(2, MAX_LEN, 64, 4, VOCAB)
    add(batch, "s", [1, 2, 3], seed=5, temperature=1.0)
    head = generate(batch, 4)["s"]
    batch.remove_request("s")  # preempted: comes back as new with its output so far
    add(batch, "other", [7], temperature=1.0)
    add(batch, "s", [1, 2, 3], head, seed=5, temperature=1.0)
    tail = generate(batch, 6)["s"]
    assert head + tail == expected


def test_different_seeds_give_different_samples():
    batch = InputBatch(2, MAX_LEN, 64, 4, VOCAB)
    add(batch, "a", [1, 2, 3], seed=1, temperature=1.0)
    add(batch, "b", [1, 2, 3], seed=2, temperature=1.0)
    out = generate(batch, 10)
    assert out["a"] != out["b"]


def test_seeded_uniforms_are_uniform_and_uncorrelated():
    n = 20_000
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003 - 5
    zero = torch.zeros(n, dtype=torch.int64)
    u = seeded_uniform(seeds, zero)
    assert u.dtype == torch.float64 and ((u > 0) & (u < 1)).all()
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert (counts - n / 10).abs().max() < 0.1 * n / 10

    def corr(a, b):
        return abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item())

    assert corr(u[:-1], u[1:]) < 0.03  # neighbouring seeds
    steps = seeded_uniform(torch.full((n,), 11), torch.arange(n))
    assert corr(steps[:-1], steps[1:]) < 0.03  # consecutive steps of one seed
    assert corr(u, seeded_uniform(seeds, zero + 1)) < 0.03
    assert torch.equal(u, seeded_uniform(seeds, zero))


def test_seeded_samples_follow_the_distribution():
    rows = 3000
    base = torch.tensor([1.5, 1.0, 0.0, -0.5] + [-40.0] * (VOCAB - 4))
    batch = InputBatch(rows, MAX_LEN, rows, 4, VOCAB)
    for i in range(rows):
        add(batch, f"r{i}", [1], seed=i, temperature=1.0)
    out = Sampler()(base.expand(rows, VOCAB).clone(), build_sampling_metadata(batch))
    freq = np.bincount(out.sampled_token_ids.numpy(), minlength=VOCAB)[:4] / rows
    np.testing.assert_allclose(freq, base[:4].softmax(-1).numpy(), atol=0.03)
