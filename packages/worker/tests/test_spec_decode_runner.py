"""The worker's speculative decoding: drafts verified in one forward, mixed batches, logprobs of
accepted tokens, and the target distribution handed to the rejection sampler.

Exactness end to end rests on two checks: ``ember_spec_decode``'s tests show that the rejection
sampler emits tokens distributed as the ``p`` it is given; here ``processed_probs`` is shown to be
the distribution the ``Sampler`` itself draws from (chi-square over 40,000 draws per setting,
failing below a p-value of 1e-6), for temperature 1, a lower temperature, top-k, top-p and min-p.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from small_worker import SMALL_SETTINGS
from transformers import AutoModelForCausalLM

from ember_scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from ember_scheduler.sampling_params import SamplingParams
from ember_spec_decode import SpeculativeConfig
from ember_worker.executor import InProcessExecutor
from ember_worker.input_batch import InputBatch
from ember_worker.sampler import Sampler
from ember_worker.sampling_metadata import build_sampling_metadata
from ember_worker.spec_sampling import processed_probs

VOCAB = 8
DRAWS = 40_000
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
NGRAM = SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=2)


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs`` (0 if a zero-probability token
    was drawn)."""
    support = probs > 0
    if bool((counts[~support] > 0).any()):
        return 0.0
    expected = probs[support].double() * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2.0, dtype=torch.float64)
    return 1.0 if dof == 0 else float(torch.special.gammaincc(dof, statistic / 2.0))


SETTINGS = {
    "temperature-1": SamplingParams(temperature=1.0),
    "temperature-0.6": SamplingParams(temperature=0.6),
    "top-k": SamplingParams(temperature=1.0, top_k=3),
    "top-p": SamplingParams(temperature=0.8, top_p=0.7),
    "min-p": SamplingParams(temperature=1.0, min_p=0.2),
}


def test_processed_probs_is_the_distribution_the_sampler_draws_from():
    params = list(SETTINGS.values())
    batch = InputBatch(len(params), 16, 64, 4, VOCAB)
    for i, p in enumerate(params):
        batch.add_request(NewRequestData(f"r{i}", [1, 2], [], p, [0], 0))
    logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    metadata = build_sampling_metadata(batch)
    probs = processed_probs(logits, batch.rows[: len(params)])
    torch.manual_seed(0)
    for row, name in enumerate(SETTINGS):
        repeat = torch.full((DRAWS,), row)
        many = dataclasses.replace(
            metadata,
            **{
                field: getattr(metadata, field)[repeat]
                for field in ("temperature", "top_p", "top_k", "min_p")
                if getattr(metadata, field) is not None
            },
            num_logprobs=[-1] * DRAWS,
        )
        drawn = Sampler()(logits[row].expand(DRAWS, VOCAB), many).sampled_token_ids
        counts = torch.bincount(drawn, minlength=VOCAB).double()
        assert p_value(counts, probs[row]) > 1e-6, name
        if name in ("top-k", "top-p", "temperature-0.6"):
            # the check can fail: the unprocessed softmax is told apart
            assert p_value(counts, logits[row].softmax(-1)) < 1e-6, name


def test_greedy_rows_get_a_one_hot_argmax():
    batch = InputBatch(1, 16, 64, 4, VOCAB)
    batch.add_request(NewRequestData("g", [1, 2], [], GREEDY, [0], 0))
    logits = torch.randn(1, VOCAB)
    probs = processed_probs(logits, batch.rows[:1])
    assert probs.tolist() == [torch.nn.functional.one_hot(logits.argmax(-1), VOCAB)[0].tolist()]


@pytest.fixture(scope="module")
def llama(tiny_model):
    return tiny_model("llama")


def executor(path, config=NGRAM):
    return InProcessExecutor(path, **SMALL_SETTINGS, speculative_config=config)


def hf_greedy_with_logprobs(path, prompt, n):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = hf.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = hf(out.sequences).logits[0, len(prompt) - 1 : len(prompt) - 1 + n]
    return tokens, logits.log_softmax(-1)


def test_one_forward_verifies_drafts_in_a_batch_that_mixes_rows_without_drafts(llama):
    prompt = [5, 6, 7, 8, 9]
    want, hf_logprobs = hf_greedy_with_logprobs(llama, prompt, 5)
    ex = executor(llama)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=2)
    a = NewRequestData("a", prompt, [], with_logprobs, [0, 1, 2, 3], 0)
    b = NewRequestData("b", prompt, [], GREEDY, [4, 5, 6, 7], 0)
    c = NewRequestData("c", prompt, [], with_logprobs, [8, 9, 10, 11], 0)
    prefill = SchedulerOutput([a, b, c], CachedRequestData(), {"a": 5, "b": 5, "c": 5}, 15)
    first = ex.execute_model(prefill)
    assert first.sampled_token_ids == [[want[0]]] * 3
    # a: the true continuation (all accepted, plus a bonus); b: no drafts; c: the second wrong.
    wrong = (want[2] + 1) % 2048
    step = SchedulerOutput(
        [],
        CachedRequestData(["a", "b", "c"], [[], [], []], [5, 5, 5]),
        {"a": 4, "b": 1, "c": 4},
        9,
        scheduled_spec_decode_tokens={"a": want[1:4], "c": [want[1], wrong, want[3]]},
    )
    out = ex.execute_model(step)
    rows = out.req_id_to_index
    assert out.sampled_token_ids[rows["a"]] == want[1:5]
    assert out.sampled_token_ids[rows["b"]] == [want[1]]
    assert out.sampled_token_ids[rows["c"]] == want[1:3]
    # One logprobs row per emitted token; the chosen token first, with its rank.
    offsets = {"a": 0, "b": 4, "c": 5}
    assert len(out.logprobs.ranks) == 7
    for req_id, count in (("a", 4), ("c", 2)):
        for j in range(count):
            row = offsets[req_id] + j
            token = want[1 + j]
            assert out.logprobs.token_ids[row][0] == token
            assert out.logprobs.ranks[row] == 1
            assert out.logprobs.logprobs[row][0] == pytest.approx(
                hf_logprobs[1 + j, token].item(), abs=1e-4
            )
    assert out.logprobs.token_ids[offsets["b"]] == []
    # Each row proposes its next drafts from its own tokens (or none where nothing matches).
    assert len(out.spec_token_ids) == 3


def test_drafts_need_a_runner_built_for_them(llama):
    ex = executor(llama, config=None)
    a = NewRequestData("a", [5, 6, 7], [], GREEDY, block_ids=[0], num_computed_tokens=0)
    step = SchedulerOutput([a], CachedRequestData(), {"a": 3}, 3)
    step.scheduled_spec_decode_tokens = {"a": [1]}
    with pytest.raises(ValueError, match="speculative_config"):
        ex.execute_model(step)


def test_a_draft_model_with_another_vocabulary_is_refused(llama, tiny_model):
    other = tiny_model("llama", vocab_size=1024)
    config = SpeculativeConfig("draft_model", 2, model=str(other))
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens"):
        executor(llama, config)
