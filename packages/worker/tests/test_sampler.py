"""Sampler: greedy, logprobs and prompt logprobs against plain torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember_scheduler.outputs import NewRequestData
from ember_scheduler.sampling_params import SamplingParams
from ember_worker.input_batch import InputBatch
from ember_worker.sampler import Sampler
from ember_worker.sampling_metadata import SamplingMetadataBuilder, build_sampling_metadata
from ember_worker.sampling_ops import argmax_rows

VOCAB = 50


def batch_of(*params: SamplingParams, prompts=None, outputs=None, eos=None) -> InputBatch:
    batch = InputBatch(max(len(params), 1), 64, 256, 4, VOCAB)
    for i, p in enumerate(params):
        prompt = prompts[i] if prompts else [1, 2, 3]
        output = outputs[i] if outputs else []
        blocks = list(range(-(-(len(prompt) + len(output)) // 4)))
        batch.add_request(NewRequestData(f"r{i}", prompt, output, p, blocks, 0, eos))
    return batch


def test_greedy_takes_the_argmax():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    batch = batch_of(*[SamplingParams(temperature=0.0)] * 3)
    out = Sampler()(logits, build_sampling_metadata(batch))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.logprobs_rows == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_reads_reduced_precision_logits_as_their_float32_values(dtype):
    """An all-greedy step takes the argmax of the model's logits as they are (no float32 copy),
    the token of the largest value, the first on ties, as of the same values widened."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits[1, [7, 3]] = 50.0  # a tie: the first index
    batch = batch_of(*[SamplingParams(temperature=0.0)] * 4)
    out = Sampler()(logits, build_sampling_metadata(batch))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.sampled_token_ids[1] == 3
    stacked = logits.view(2, 2, VOCAB)  # argmax_rows keeps the leading dims
    assert torch.equal(argmax_rows(stacked), logits.float().argmax(-1).view(2, 2))


def test_logprobs_top_n_chosen_token_and_rank():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    batch = batch_of(
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
    )
    out = Sampler()(logits, build_sampling_metadata(batch))
    assert out.logprobs_rows == [0, 2]
    reference = torch.log_softmax(logits.double(), -1)
    lp = out.logprobs
    top3 = reference[0].topk(3)
    assert lp.token_ids[0] == [int(logits[0].argmax()), *top3.indices.tolist()]
    np.testing.assert_allclose(
        lp.logprobs[0], [reference[0].max().item(), *top3.values.tolist()], atol=1e-5
    )
    assert lp.token_ids[1] == [int(logits[2].argmax())]
    assert lp.ranks == [1, 1]


def test_prompt_logprobs_of_given_targets():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(2))
    targets = torch.tensor([3, 0, 49, 7, 7])
    lp = Sampler.compute_prompt_logprobs(logits, targets, 2)
    reference = torch.log_softmax(logits.double(), -1)
    for i, t in enumerate(targets.tolist()):
        assert lp.token_ids[i][0] == t
        assert lp.token_ids[i][1:] == reference[i].topk(2).indices.tolist()
        assert abs(lp.logprobs[i][0] - reference[i, t].item()) < 1e-5
        assert lp.ranks[i] == int((reference[i] > reference[i, t]).sum()) + 1
    with pytest.raises(ValueError, match="target_token_ids"):
        Sampler.compute_prompt_logprobs(logits, targets[:2], 2)


def test_metadata_leaves_out_unused_features_and_neutralizes_greedy_rows():
    batch = batch_of(
        SamplingParams(temperature=0.0, top_k=0, top_p=0.5),
        SamplingParams(temperature=0.8, top_k=3),
    )
    meta = build_sampling_metadata(batch)
    assert not meta.all_greedy and not meta.all_random
    # The greedy row would otherwise force ranking the whole vocabulary.
    assert meta.top_k.tolist() == [1, 3] and meta.top_k.dtype == torch.int32
    assert meta.top_p is None and meta.min_p is None and meta.no_penalties
    assert meta.has_seed is None and meta.max_num_logprobs is None
    greedy_only = build_sampling_metadata(
        batch_of(SamplingParams(temperature=0.0, top_k=5, seed=1))
    )
    assert greedy_only.all_greedy and greedy_only.top_k is None and greedy_only.has_seed is None


def test_logprobs_when_every_row_asked_follow_the_sampled_tokens():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    batch = batch_of(
        SamplingParams(temperature=1.0, seed=3, logprobs=1),
        SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0),
    )
    out = Sampler()(logits, build_sampling_metadata(batch))
    assert out.logprobs_rows == [0, 1]
    reference = torch.log_softmax(logits.double(), -1)  # raw logits, before penalties
    for row, token in enumerate(out.sampled_token_ids.tolist()):
        assert out.logprobs.token_ids[row][0] == token
        assert abs(out.logprobs.logprobs[row][0] - reference[row, token].item()) < 1e-5
        assert len(out.logprobs.token_ids[row]) == 1 + (1, 2)[row]
        assert out.logprobs.ranks[row] == int((reference[row] > reference[row, token]).sum()) + 1


EOS, STOP = 7, 11


def test_eos_and_stop_ids_are_masked_below_min_tokens_only():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(5))
    logits[:, STOP] = 10.0  # the argmax everywhere
    logits[:, EOS] = 9.0  # the runner-up
    logits[5, STOP] = -10.0  # row 5 has no stop ids: EOS is its argmax
    greedy = dict(temperature=0.0, stop_token_ids=[STOP])
    batch = batch_of(
        SamplingParams(min_tokens=3, logprobs=1, **greedy),  # 0 outputs
        SamplingParams(min_tokens=3, **greedy),  # 2 outputs
        SamplingParams(min_tokens=3, **greedy),  # 3 outputs: at min_tokens, no mask
        SamplingParams(min_tokens=3, ignore_eos=True, **greedy),  # EOS not masked
        SamplingParams(**greedy),  # no min_tokens
        SamplingParams(min_tokens=5, temperature=0.0),  # EOS only
        outputs=[[], [5, 6], [5, 6, 8], [], [], [1]],
        eos=EOS,
    )
    out = Sampler()(logits, build_sampling_metadata(batch))
    masked = logits.clone()
    masked[[0, 1], EOS] = masked[[0, 1, 3], STOP] = masked[5, EOS] = float("-inf")
    expected = masked.argmax(-1)
    assert not {EOS, STOP} & set(expected[[0, 1, 5]].tolist())
    assert expected[2:5].tolist() == [STOP, EOS, STOP]
    assert out.sampled_token_ids.tolist() == expected.tolist()
    # Logprobs still describe the model's raw distribution, in which STOP is the top token.
    reference = torch.log_softmax(logits[0].double(), -1)
    assert out.logprobs.token_ids[0] == [int(expected[0]), STOP]
    assert abs(out.logprobs.logprobs[0][1] - reference[STOP].item()) < 1e-5
    assert out.logprobs.ranks[0] == int((reference > reference[expected[0]]).sum()) + 1


@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_rows_below_min_tokens_never_draw_eos_or_stop_ids(top_k):
    rows = 32
    logits = torch.zeros(rows, VOCAB)
    logits[:, EOS] = logits[:, STOP] = 30.0  # all the mass, unmasked
    params = SamplingParams(temperature=1.0, top_k=top_k, min_tokens=2, stop_token_ids=[STOP])
    batch = batch_of(*[params] * rows, eos=EOS)
    for _ in range(4):
        sampled = Sampler()(logits, build_sampling_metadata(batch)).sampled_token_ids
        assert not bool(((sampled == EOS) | (sampled == STOP)).any())
    unmasked = batch_of(*[params.clone(min_tokens=0)] * rows, eos=EOS)
    sampled = Sampler()(logits, build_sampling_metadata(unmasked)).sampled_token_ids
    assert bool(((sampled == EOS) | (sampled == STOP)).all())


def test_no_min_tokens_mask_without_a_row_that_needs_it():
    no_ids = batch_of(SamplingParams(min_tokens=4), SamplingParams(min_tokens=4, ignore_eos=True))
    assert build_sampling_metadata(no_ids).min_tokens_mask is None  # no EOS known, no stop ids
    reached = batch_of(SamplingParams(min_tokens=1), outputs=[[4]], eos=EOS)
    assert build_sampling_metadata(reached).min_tokens_mask is None
    past_vocab = batch_of(SamplingParams(min_tokens=2, stop_token_ids=[VOCAB + 5]))
    assert build_sampling_metadata(past_vocab).min_tokens_mask is None


def test_metadata_builder_keeps_steady_metadata_until_the_rows_change():
    batch = batch_of(SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5))
    builder = SamplingMetadataBuilder(batch)
    first = builder.build()
    assert builder.build() is first  # nothing changed: the same metadata
    batch.remove_request("r0")
    batch.condense()  # "r1" moves to row 0
    moved = builder.build()
    assert moved is not first
    assert moved.temperature.tolist() == pytest.approx([0.8])
    assert moved.top_k.tolist() == [5] and not moved.all_greedy
    batch.add_request(NewRequestData("r2", [1, 2], [], SamplingParams(temperature=0.0), [0], 0))
    assert builder.build().temperature.shape == (2,)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, presence_penalty=0.5),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.0, min_tokens=4),
    ],
)
def test_metadata_builder_gathers_step_dependent_metadata_every_step(params):
    batch = batch_of(params, eos=7)
    builder = SamplingMetadataBuilder(batch)
    first = builder.build()
    batch.append_token_runs(np.array([[9]]), np.array([1]))  # one more output token
    second = builder.build()
    assert second is not first
    if params.presence_penalty:
        assert second.output_token_counts[0, 9] == 1
    if params.seed is not None:
        assert second.num_output_tokens.tolist() == [first.num_output_tokens.item() + 1]
