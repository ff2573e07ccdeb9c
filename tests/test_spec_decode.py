"""Speculative decoding end to end: greedy outputs equal transformers' token for token.

Both proposers (prompt lookup; a draft model, one layer with the same tokenizer, and the target
as its own draft, where every draft must be accepted), for every architecture, under
preemption, chunked prefill and prefix caching. Seeded sampling with speculation is reproducible
whatever else is in the batch. Requests with structured outputs speculate too, and produce what
they produce without speculation. With async scheduling the scheduler reserves the drafts' slots
before it has seen them and the worker feeds its own: greedy outputs stay transformers'.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from test_parity import (
    MAX_MODEL_LEN,
    assert_matches_hf,
    greedy,
    hf_greedy,
    make_engine,
    model_path,
    parity_prompts,
    run,
)
from transformers import AutoTokenizer

from ember_scheduler.sampling_params import SamplingParams
from ember_scheduler.structured_outputs import StructuredOutputsParams
from ember_spec_decode import SpeculativeConfig
from ember_testing.tiny_models import ARCHITECTURES, tiny_model_path

NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)


def one_layer_draft(arch: str) -> SpeculativeConfig:
    path = tiny_model_path(arch, seed=7, num_hidden_layers=1)
    return SpeculativeConfig("draft_model", 3, model=str(path))


# (KV blocks, step token budget, prefix caching): preemption, chunked prefill, prefix caching.
SETTINGS = {
    "preemption": dict(num_blocks=40),
    "chunked-prefill": dict(max_num_batched_tokens=24),
    "prefix-caching": dict(prefix_caching=True),
}


def run_twice_if_cached(core, prefix_caching: bool):
    """Generate the parity prompts; with prefix caching, a second time over the warm cache."""
    outputs, totals = run(core, parity_prompts(), greedy, prefix="a-")
    runs = [outputs]
    if prefix_caching:
        second, second_totals = run(core, parity_prompts(), greedy, prefix="b-")
        assert second_totals["prefix_cache_hits"] > 0
        runs.append(second)
        for key in ("num_draft_tokens", "num_accepted_tokens", "num_preemptions"):
            totals[key] += second_totals[key]
    return runs, totals


# Preemption, chunked prefill and prefix caching at once: a small pool, a small step budget,
# and a second run over the warm cache.
COMBINED = dict(num_blocks=64, max_num_batched_tokens=40, prefix_caching=True)


def assert_greedy_parity(arch: str, config: SpeculativeConfig, settings: dict) -> dict:
    prefix_caching = settings.get("prefix_caching", False)
    core = make_engine(arch, speculative_config=config, **settings)
    runs, totals = run_twice_if_cached(core, prefix_caching)
    if "num_blocks" in settings:
        assert totals["num_preemptions"] > 0
    # an unrelated random one-layer draft may never agree with the target: it must draft
    key = "num_accepted_tokens" if config.method == "ngram" else "num_draft_tokens"
    assert totals[key] > 0
    for outputs in runs:
        assert_matches_hf(arch, outputs)
    return totals


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_ngram_greedy_parity(arch):
    assert_greedy_parity(arch, NGRAM, COMBINED)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_draft_model_greedy_parity(arch):
    assert_greedy_parity(arch, one_layer_draft(arch), COMBINED)


@pytest.mark.parametrize("proposer", ["ngram", "draft-model"])
def test_async_scheduling_greedy_parity(proposer):
    config = NGRAM if proposer == "ngram" else one_layer_draft("llama")
    core = make_engine(
        "llama", speculative_config=config, async_scheduling=True, **dict(COMBINED, num_blocks=40)
    )
    outputs, totals = run(core, parity_prompts(), greedy)
    # preempted with a step in flight, a request resumes without the drafts that step proposed
    assert totals["num_preemptions"] > 0
    # drafts were rejected: the worker's and the scheduler's rollbacks were exercised
    assert totals["num_accepted_tokens"] < totals["num_draft_tokens"]
    if proposer == "ngram":
        assert totals["num_accepted_tokens"] > 0
    assert_matches_hf("llama", outputs)


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("proposer", ["ngram", "draft-model"])
def test_async_scheduling_greedy_parity_per_setting(arch, setting, proposer):
    config = NGRAM if proposer == "ngram" else one_layer_draft(arch)
    core = make_engine(arch, speculative_config=config, async_scheduling=True, **SETTINGS[setting])
    outputs, totals = run(core, parity_prompts(), greedy)
    assert totals["num_draft_tokens"] > 0
    if "num_blocks" in SETTINGS[setting]:
        assert totals["num_preemptions"] > 0
    assert_matches_hf(arch, outputs)


def test_async_scheduling_with_the_target_as_its_own_draft_accepts_every_draft():
    config = SpeculativeConfig("draft_model", 4, model=str(tiny_model_path("llama")))
    core = make_engine(
        "llama", speculative_config=config, async_scheduling=True, max_num_batched_tokens=40
    )
    outputs, totals = run(core, parity_prompts(), greedy)
    assert 0 < totals["num_accepted_tokens"] == totals["num_draft_tokens"]
    assert_matches_hf("llama", outputs)


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("proposer", ["ngram", "draft-model"])
def test_greedy_parity_per_setting(arch, setting, proposer):
    config = NGRAM if proposer == "ngram" else one_layer_draft(arch)
    assert_greedy_parity(arch, config, SETTINGS[setting])


@pytest.mark.parametrize(
    "arch", [a if a == "llama" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHITECTURES]
)
def test_target_as_its_own_draft_accepts_every_draft(arch):
    config = SpeculativeConfig("draft_model", 4, model=str(tiny_model_path(arch)))
    core = make_engine(arch, speculative_config=config, num_blocks=64, max_num_batched_tokens=40)
    outputs, totals = run(core, parity_prompts(), greedy)
    assert totals["num_draft_tokens"] > 0
    assert totals["num_accepted_tokens"] == totals["num_draft_tokens"]
    assert_matches_hf(arch, outputs)


def test_a_partial_prefix_hit_copies_the_draft_models_kv_too():
    """A prompt answered once, then again: the second request copies the first one's last,
    partly filled block, in the draft's cache as in the target's. With the target as its own
    draft every draft is accepted only if both caches hold the same KV."""
    config = SpeculativeConfig("draft_model", 4, model=str(tiny_model_path("llama")))
    core = make_engine("llama", speculative_config=config, prefix_caching=True)
    prompts = [p for p in parity_prompts() if len(p) % 16]
    run(core, prompts, lambda i: greedy(i, 1), prefix="first-")
    outputs, totals = run(core, prompts, greedy, prefix="again-")
    assert totals["prefix_cache_hits"] == sum(len(p) - 1 for p in prompts)
    assert 0 < totals["num_accepted_tokens"] == totals["num_draft_tokens"]
    for i, prompt in enumerate(prompts):
        want = hf_greedy("llama")[parity_prompts().index(prompt)]
        assert tuple(outputs[i]["tokens"]) == want


@pytest.mark.parametrize("config", [NGRAM, one_layer_draft("llama")], ids=["ngram", "draft-model"])
def test_seeded_sampling_is_reproducible_whatever_the_batch(config):
    prompts = parity_prompts()

    def seeded(i):
        return SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=32)

    alone, _ = run(make_engine("llama", speculative_config=config), prompts[:1], seeded)
    together, totals = run(make_engine("llama", speculative_config=config), prompts, seeded)
    assert totals["num_draft_tokens"] > 0
    assert alone[0]["tokens"] == together[0]["tokens"]


def test_a_run_reaching_max_model_len_mid_step_is_cut_there():
    # The target as its own draft proposes 4 tokens every step; the context fills in the middle.
    config = SpeculativeConfig("draft_model", 4, model=str(tiny_model_path("llama")))
    prompt = parity_prompts()[-1][:100] * 2 + [7] * (MAX_MODEL_LEN - 207)
    until_full = SamplingParams(temperature=0.0, ignore_eos=True)
    got, _ = run(make_engine("llama", speculative_config=config), [prompt], lambda i: until_full)
    want, _ = run(make_engine("llama"), [prompt], lambda i: until_full)
    assert len(prompt) + len(got[0]["tokens"]) == MAX_MODEL_LEN
    assert got[0]["tokens"] == want[0]["tokens"]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "tags", "score"],
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
LABELS = ["positive", "negative", "neutral"]
CONSTRAINED = [
    StructuredOutputsParams(json=SCHEMA),
    StructuredOutputsParams(regex=DATE),
    StructuredOutputsParams(choice=LABELS),
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
]


def constrained_or_free(num_constrained: int):
    """Greedy params: the first ``num_constrained`` requests cycle through ``CONSTRAINED``."""

    def params(i: int) -> SamplingParams:
        if i >= num_constrained:
            return SamplingParams(temperature=0.0, max_tokens=48)
        spec = CONSTRAINED[i % len(CONSTRAINED)]
        return SamplingParams(temperature=0.0, max_tokens=160, structured_outputs=spec)

    return params


def assert_valid(spec: StructuredOutputsParams, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert text in spec.choice


# The target as its own draft: its unmasked drafts are accepted wherever the grammar allows them.
SELF_DRAFT = SpeculativeConfig("draft_model", 3, model=str(tiny_model_path("llama")))


@pytest.mark.parametrize(
    "config",
    [NGRAM, pytest.param(SELF_DRAFT, marks=pytest.mark.slow)],
    ids=["ngram", "draft-model"],
)
def test_constrained_requests_speculate_and_match_their_output_without_speculation(config):
    prompts = parity_prompts()
    tokenizer = AutoTokenizer.from_pretrained(model_path("llama"))
    constrained = len(CONSTRAINED) * 2
    params = constrained_or_free(constrained)

    alone, totals = run(
        make_engine("llama", speculative_config=config), prompts[:constrained], params
    )
    assert totals["num_draft_tokens"] > 0  # drafts of constrained rows only
    assert totals["num_accepted_tokens"] > 0
    mixed, _ = run(make_engine("llama", speculative_config=config), prompts, params)
    want, _ = run(make_engine("llama"), prompts, params)
    for i, output in want.items():
        assert mixed[i]["tokens"] == output["tokens"], i
        if i < constrained:
            assert alone[i]["tokens"] == output["tokens"], i
            tokens = output["tokens"]
            assert tokens[-1] == 2  # the grammar ended the request at its EOS
            assert_valid(CONSTRAINED[i % len(CONSTRAINED)], tokenizer.decode(tokens[:-1]))
