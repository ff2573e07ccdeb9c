"""Penalties, temperature, min-p, top-k and top-p against per-row references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import InputBatch
from ember_worker.sampler import Sampler
from ember_worker.sampling_metadata import build_sampling_metadata
from ember_worker.sampling_ops import (
    apply_min_p_,
    apply_penalties,
    inverse_cdf_sample,
    to_float32,
    top_k_top_p_candidates,
)

VOCAB = 40


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def batch_of(params: list[SamplingParams], vocab: int = VOCAB, prompts=None, outputs=None):
    """A batch with one row per params, each with prompt ``[1]`` unless ``prompts`` says."""
    batch = InputBatch(len(params), 32, 64, 4, vocab)
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [1]
        output = outputs[i] if outputs else []
        batch.add_request(NewRequestData(f"r{i}", prompt, output, p, [0], 0))
    return batch


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().squeeze(1).tolist())


def kept_candidates(values: torch.Tensor, token_ids: torch.Tensor | None, row: int) -> set[int]:
    if token_ids is None:  # masked logits in vocabulary order
        return kept(values[row])
    assert (values[row, :-1] >= values[row, 1:]).all()  # descending
    return set(token_ids[row][torch.isfinite(values[row])].tolist())


@pytest.mark.parametrize("vocab", [40, 400])  # whole-row thresholds, and ranked candidates
def test_top_k_keeps_the_k_largest_per_row(vocab):
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    top_k = torch.tensor([1, 5, 3, 2]) if vocab > 40 else torch.tensor([1, 5, 0, vocab + 3])
    values, ids = top_k_top_p_candidates(logits, top_k, None)
    assert (ids is None) == (vocab == 40)
    for row, k in enumerate(top_k.tolist()):
        expected = set(logits[row].topk(min(k, vocab) if k else vocab).indices.tolist())
        assert kept_candidates(values, ids, row) == expected
        finite = torch.isfinite(values[row])
        tokens = finite.nonzero().squeeze(1) if ids is None else ids[row][finite]
        assert torch.equal(values[row][finite], logits[row][tokens])


def test_top_k_ranks_only_the_largest_k_when_every_row_has_one():
    logits = torch.randn(3, 400, generator=torch.Generator().manual_seed(7))
    values, ids = top_k_top_p_candidates(
        logits, torch.tensor([2, 6, 4]), torch.tensor([1.0, 0.5, 1.0])
    )
    assert values.shape == (3, 6)
    for row, k in enumerate([2, 6, 4]):
        assert ids[row, :k].tolist() == logits[row].topk(k).indices.tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = random_logits(4, 1)
    top_p = torch.tensor([0.1, 0.5, 0.9, 1.0])
    values, ids = top_k_top_p_candidates(logits, None, top_p)
    for row, p in enumerate(top_p.tolist()):
        probs = logits[row].double().softmax(-1)
        order = probs.argsort(descending=True).tolist()
        expected, mass = set(), 0.0
        for token in order:
            expected.add(token)
            mass += probs[token].item()
            if mass >= p - 1e-6:
                break
        assert kept_candidates(values, ids, row) == expected


def reference_top_k_top_p(row: torch.Tensor, k: int, p: float) -> set[int]:
    order = row.double().argsort(descending=True)
    if k:
        order = order[:k]
    if p >= 1.0:  # disabled: even tokens whose probability underflows stay
        return set(order.tolist())
    probs = row.double()[order].softmax(-1)
    kept, mass = set(), 0.0
    for token, prob in zip(order.tolist(), probs.tolist()):
        kept.add(token)
        mass += prob
        if mass >= p - 1e-9:
            break
    return kept


def test_peaked_rows_rank_only_the_tokens_top_p_can_keep():
    """Large vocabulary, peaked rows: the candidate bound keeps ranking far below a full sort,
    and the kept sets still match a full-sort reference, for top-p-only and top-k rows alike."""
    vocab = 4096
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, vocab, generator=g) * 6
    top_k = torch.tensor([0, 0, 7, 0])
    top_p = torch.tensor([0.3, 0.9, 0.8, 0.99])
    values, ids = top_k_top_p_candidates(logits, top_k, top_p)
    assert values.shape[1] <= vocab // 8
    for row in range(4):
        expected = reference_top_k_top_p(logits[row], int(top_k[row]), float(top_p[row]))
        assert kept_candidates(values, ids, row) == expected


def test_top_k_then_top_p_renormalizes_over_the_top_k():
    logits = random_logits(1, 2)
    values, ids = top_k_top_p_candidates(logits, torch.tensor([3]), torch.tensor([0.6]))
    top3 = logits[0].topk(3)
    probs = top3.values.softmax(-1)
    n = 1 if probs[0] >= 0.6 else 2 if probs[0] + probs[1] >= 0.6 else 3
    assert kept_candidates(values, ids, 0) == set(top3.indices[:n].tolist())


@pytest.mark.parametrize("width,chunk", [(700, 256), (512, 64), (5, 256)])
def test_two_level_inverse_cdf_matches_a_flat_cumulative_sum(width, chunk):
    g = torch.Generator().manual_seed(width)
    # integer weights with many zeros (and zero chunks): every sum is exact, so both agree
    weights = torch.randint(0, 4, (3, width), generator=g).float()
    weights[:, : width // 3] = 0
    weights[:, -1] = 1
    uniform = torch.rand(3, 400, generator=g, dtype=torch.float64)
    flat = weights.double().cumsum(-1)
    for j in range(400):
        u = uniform[:, j]
        expected = torch.searchsorted(flat, (u * flat[:, -1])[:, None], right=True)[:, 0]
        got = inverse_cdf_sample(weights, u, chunk=chunk)
        assert torch.equal(got, expected)
        assert (weights.gather(1, got[:, None]) > 0).all()


def test_inverse_cdf_never_picks_zero_probability_entries():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    for u in (0.0, 0.25, 0.4999999, 0.5, 0.9999999999):
        picks = inverse_cdf_sample(probs, torch.tensor([u, u], dtype=torch.float64)).tolist()
        assert picks[0] == (1 if u < 0.5 else 3) and picks[1] == 4


def test_min_p_masks_tokens_below_a_fraction_of_the_top():
    logits = random_logits(3, 3)
    min_p = torch.tensor([0.0, 0.2, 1.0])
    out = apply_min_p_(logits.clone(), min_p)
    for row, m in enumerate(min_p.tolist()):
        probs = logits[row].softmax(-1)
        assert kept(out[row]) == set((probs >= m * probs.max()).nonzero().squeeze(1).tolist())


def reference_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's definitions, one token at a time."""
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value / repetition if value > 0 else value * repetition
    for token in set(output):
        out[token] -= frequency * output.count(token) + presence
    return out


def test_penalties_match_the_reference():
    logits = random_logits(3, 4)
    prompts = [[1, 2, 2, 3], [5], [7, 8]]
    outputs = [[2, 2, 9], [5, 5, 5, 6], []]
    params = [(0.5, 0.3, 1.5), (-1.0, 0.0, 0.8), (2.0, 2.0, 1.0)]
    counts = torch.zeros(3, VOCAB)
    mask = torch.zeros(3, VOCAB, dtype=torch.bool)
    for row in range(3):
        for token in outputs[row]:
            counts[row, token] += 1
        mask[row, prompts[row]] = True
    presence, frequency, repetition = (torch.tensor(col) for col in zip(*params))
    out = apply_penalties(logits.clone(), counts, mask, presence, frequency, repetition)
    for row in range(3):
        expected = reference_penalties(logits[row], prompts[row], outputs[row], *params[row])
        torch.testing.assert_close(out[row], expected)


def test_penalties_through_the_batch_change_the_greedy_choice():
    """Counts and prompt masks come from the batch's own rows; padding is not counted."""
    logits = torch.zeros(3, VOCAB)
    logits[:, 10] = 3.0  # favourite
    logits[:, 11] = 2.5  # runner-up
    specs = [
        ([10, 1], [], SamplingParams(temperature=0, repetition_penalty=2.0)),  # 10 -> 1.5
        ([1], [10, 10], SamplingParams(temperature=0, frequency_penalty=0.3)),  # 10 -> 2.4
        ([1], [10], SamplingParams(temperature=0, presence_penalty=0.3)),  # 10 -> 2.7
    ]
    prompts, outputs, params = zip(*specs)
    batch = batch_of(params, prompts=prompts, outputs=outputs)
    batch.token_ids_cpu[:, 3:] = 10  # padding full of the favourite must not count
    out = Sampler()(logits, build_sampling_metadata(batch))
    assert out.sampled_token_ids.tolist() == [11, 11, 10]


def test_temperature_shapes_the_distribution():
    """Empirical frequencies over many unseeded rows match softmax(logits / T)."""
    torch.manual_seed(0)
    rows = 4000
    base = torch.tensor([2.0, 1.0, 0.0, -1.0] + [-30.0] * (VOCAB - 4))
    for temperature in (0.5, 1.5):
        batch = batch_of([SamplingParams(temperature=temperature)] * rows)
        out = Sampler()(base.expand(rows, VOCAB).clone(), build_sampling_metadata(batch))
        freq = np.bincount(out.sampled_token_ids.numpy(), minlength=VOCAB)[:4] / rows
        expected = (base[:4] / temperature).softmax(-1).numpy()
        np.testing.assert_allclose(freq, expected, atol=0.03)


def test_greedy_and_sampled_rows_mix():
    logits = random_logits(4, 5)
    batch = batch_of(
        [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=1.0, top_k=1),
            SamplingParams(temperature=0.0, top_k=3),
            SamplingParams(temperature=0.9, min_p=1.0),
        ]
    )
    meta = build_sampling_metadata(batch)
    assert not meta.all_greedy and not meta.all_random
    out = Sampler()(logits, meta)
    # top_k=1 and min_p=1 both leave only the argmax.
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_sampler_rejects_mismatched_logits():
    batch = batch_of([SamplingParams()])
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, VOCAB), build_sampling_metadata(batch))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_masked_tokens_are_never_sampled(temperature):
    torch.manual_seed(1)
    rows = 256
    params = SamplingParams(temperature=temperature, top_k=4, top_p=0.8, min_p=0.05)
    batch = batch_of([params] * rows)
    logits = random_logits(1, 6).expand(rows, VOCAB).clone()
    out = Sampler()(logits, build_sampling_metadata(batch))
    values, ids = top_k_top_p_candidates(
        apply_min_p_(logits[:1] / (temperature or 1.0), torch.tensor([0.05])),
        torch.tensor([4]),
        torch.tensor([0.8]),
    )
    if temperature:
        assert set(out.sampled_token_ids.tolist()) <= kept_candidates(values, ids, 0)
    else:
        assert set(out.sampled_token_ids.tolist()) == {int(logits[0].argmax())}


def test_rows_with_and_without_truncation_in_one_batch():
    torch.manual_seed(3)
    vocab = 512
    rows = 64
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(9)) * 4
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=2),
        SamplingParams(temperature=0.0),
    ]
    batch = batch_of([kinds[i % 4] for i in range(rows)], vocab)
    out = Sampler()(base.expand(rows, vocab).clone(), build_sampling_metadata(batch))
    picks = out.sampled_token_ids.view(-1, 4)
    allowed_p = reference_top_k_top_p(base, 0, 0.5)
    allowed_k = set(base.topk(2).indices.tolist())
    assert set(picks[:, 1].tolist()) <= allowed_p
    assert set(picks[:, 2].tolist()) <= allowed_k
    assert set(picks[:, 3].tolist()) == {int(base.argmax())}
    # the plain rows draw from the whole distribution, not a truncated one
    assert not set(picks[:, 0].tolist()) <= allowed_p | allowed_k


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 3.0
    logits[:, 11] = 2.5
    params = SamplingParams(temperature=0, frequency_penalty=0.2, presence_penalty=0.2)
    # A row with the token only in its prompt, and one with it twice in its output.
    batch = batch_of([params] * 2, prompts=[[10, 10, 10], [1]], outputs=[[], [10, 10]])
    meta = build_sampling_metadata(batch)
    assert meta.prompt_token_mask is None and meta.repetition_penalties is None
    assert meta.output_token_counts[:, 10].tolist() == [0.0, 2.0]
    # 3.0 - 0.2 * 2 - 0.2 = 2.4 < 2.5
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [10, 11]


@pytest.mark.parametrize("vocab", [40, 4096])
def test_top_k_and_top_p_together_match_the_reference_on_both_paths(vocab):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, vocab, generator=g) * (6 if vocab > 40 else 1)
    top_k = torch.tensor([0, 20, 3, 0, 1, 30])
    # A row with neither (k=0, p=1) needs the whole vocabulary: only on the small one.
    top_p = torch.tensor([0.6, 0.6, 0.95, 1.0 if vocab == 40 else 0.9, 0.5, 0.2])
    values, ids = top_k_top_p_candidates(logits, top_k, top_p)
    assert (ids is None) == (vocab == 40)
    for row in range(6):
        expected = reference_top_k_top_p(logits[row], int(top_k[row]), float(top_p[row]))
        assert kept_candidates(values, ids, row) == expected, row


def test_a_top_k_row_keeps_its_cut_beside_a_top_p_row_on_the_whole_row_path():
    # Top-p of 1 (no top-p) in the same call as a row with top-p below 1: the row's top-k must
    # still hold. On the whole-row path it once kept the whole vocabulary.
    logits = random_logits(2, 5)
    values, ids = top_k_top_p_candidates(logits, torch.tensor([10, 0]), torch.tensor([1.0, 0.9]))
    assert ids is None  # the whole-row path: 10 > 40 // 8
    assert kept(values[0]) == set(logits[0].topk(10).indices.tolist())


@pytest.mark.parametrize("shape", [(1, 151936), (3, 1000), (2, 7)])
def test_bfloat16_logits_widen_bit_for_bit_as_torch_widens_them(shape):
    values = torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 50
    values[0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    logits = values.to(torch.bfloat16)
    with torch.inference_mode():  # as the model runner calls it
        wide = to_float32(logits.clone())
    assert wide.dtype == torch.float32
    assert torch.equal(wide.view(torch.int32), logits.to(torch.float32).view(torch.int32))
    assert to_float32(values) is values
