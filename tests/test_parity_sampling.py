"""Logprobs against transformers' log-softmax, and reproducible seeded sampling, end to end."""

from __future__ import annotations

import pytest
import torch
from test_parity import hf_model, make_engine, parity_prompts, run

from ember_scheduler.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NUM_LOGPROBS = 5


def _hf_log_softmax(arch: str, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(arch)(torch.tensor([tokens])).logits[0]
    return logits.float().log_softmax(-1)


def _check_rows(rows, expected: torch.Tensor, targets: list[int]) -> None:
    """``rows``: Logprobs of consecutive positions; ``expected[k]`` the reference distribution
    that predicts ``targets[k]``."""
    token_ids = [t for chunk in rows for t in chunk.token_ids]
    values = [v for chunk in rows for v in chunk.logprobs]
    ranks = [r for chunk in rows for r in chunk.ranks]
    assert len(token_ids) == len(targets)
    for k, target in enumerate(targets):
        assert token_ids[k][0] == target
        ref = expected[k]
        top_values, top_ids = ref.topk(NUM_LOGPROBS)
        assert token_ids[k][1:] == top_ids.tolist()
        got = torch.tensor(values[k], dtype=torch.float32)
        want = torch.cat([ref[target : target + 1], top_values])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        # Tokens within the logprob tolerance of the target may rank either side of it.
        above, near = int((ref > ref[target] + 1e-4).sum()), int((ref > ref[target] - 1e-4).sum())
        assert above + 1 <= ranks[k] <= near  # near counts the target itself


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_and_prompt_logprobs_match_transformers(arch):
    prompts = [parity_prompts()[i] for i in (15, 3, 11)]  # 110, ~60 and 5 tokens
    params = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=NUM_LOGPROBS,
        prompt_logprobs=NUM_LOGPROBS,
    )  # fmt: skip
    # A token budget of 24 splits the prompts' logprobs over several chunks.
    outputs, _ = run(make_engine(arch, max_num_batched_tokens=24), prompts, lambda _i: params)
    for i, prompt in enumerate(prompts):
        generated = outputs[i]["tokens"]
        assert len(generated) == 12
        assert len(set(generated)) >= 6  # not a repeated token: the rows check many contexts
        reference = _hf_log_softmax(arch, prompt + generated)
        _check_rows(outputs[i]["prompt_logprobs"], reference[: len(prompt) - 1], prompt[1:])
        _check_rows(outputs[i]["logprobs"], reference[len(prompt) - 1 : -1], generated)


def _seeded(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=0.95, top_k=200, seed=seed, max_tokens=32, ignore_eos=True
    )


def _others(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=1.0, max_tokens=40 + i, ignore_eos=True)
    return SamplingParams(temperature=0.7, top_k=20, seed=100 + i, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_seeded_sampling_is_reproducible_and_batch_independent(arch):
    prompt = parity_prompts()[4]
    alone, _ = run(make_engine(arch), [prompt], lambda _i: _seeded(1234))
    again, _ = run(make_engine(arch), [prompt], lambda _i: _seeded(1234))
    tokens = alone[0]["tokens"]
    assert len(tokens) == 32
    assert again[0]["tokens"] == tokens

    # Inside a batch of unseeded and differently seeded requests, under preemption.
    batch = [prompt, *parity_prompts(seed=7)[:11]]
    params = lambda i: _seeded(1234) if i == 0 else _others(i)  # noqa: E731
    crowded, totals = run(make_engine(arch, num_blocks=24), batch, params)
    assert totals["num_preemptions"] > 0
    assert crowded[0]["tokens"] == tokens

    greedy, _ = run(
        make_engine(arch), [prompt], lambda _i: SamplingParams(temperature=0.0, max_tokens=32)
    )
    other_seed, _ = run(make_engine(arch), [prompt], lambda _i: _seeded(99))
    assert tokens != greedy[0]["tokens"]  # really sampled
    assert tokens != other_seed[0]["tokens"]
