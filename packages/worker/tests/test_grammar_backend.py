"""The xgrammar backend: spec checks, the compile cache, masks on constrained rows, rollback,
masks at speculative draft positions."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from ember_scheduler import StructuredOutputsParams
from ember_worker.structured_outputs import (
    GrammarMatchers,
    XGrammarCompiler,
    check_structured_outputs,
)

VOCAB = 2048
EOS = 2


@pytest.fixture(scope="module")
def compiler(test_tokenizer_path):
    compiler = XGrammarCompiler(test_tokenizer_path, VOCAB)
    yield compiler
    compiler.shutdown()


@pytest.fixture(scope="module")
def tokenizer(test_tokenizer_path):
    return AutoTokenizer.from_pretrained(test_tokenizer_path)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"json": {"type": "strin"}}, "json"),
        ({"json": {"$ref": "#/$defs/missing"}}, "json"),
        ({"regex": "[a-"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
        ({"grammar": "root ::= ("}, "grammar"),
    ],
)
def test_bad_specs_are_value_errors_naming_the_field(fields, field):
    spec = StructuredOutputsParams(**fields)
    with pytest.raises(
        ValueError, match=rf"^SamplingParams\.structured_outputs\.{field} is invalid"
    ):
        check_structured_outputs(spec)


def test_compiles_are_cached_by_spec_and_errors_stay_in_the_future(compiler):
    spec = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}}
    )
    first = compiler.compile(spec)
    assert compiler.compile(StructuredOutputsParams(json=dict(spec.json))) is first
    assert first.result(timeout=30) is not None
    other = compiler.compile(StructuredOutputsParams(json=spec.json, disable_any_whitespace=True))
    assert other is not first
    bad = compiler.compile(StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is invalid"):
        bad.result(timeout=30)


def test_the_cache_forgets_the_least_recently_used_spec(test_tokenizer_path):
    small = XGrammarCompiler(test_tokenizer_path, VOCAB, cache_size=2)
    try:
        a, b, c = (StructuredOutputsParams(choice=[name]) for name in "abc")
        future_a = small.compile(a)
        future_b = small.compile(b)
        assert small.compile(a) is future_a  # a is now the most recent
        small.compile(c)  # evicts b
        assert small.compile(a) is future_a
        assert small.compile(b) is not future_b
    finally:
        small.shutdown()


def _encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_bitmask_touches_only_constrained_rows(compiler, tokenizer):
    matchers = GrammarMatchers(compiler, max_num_reqs=4)
    matchers.add_request("digits", StructuredOutputsParams(regex="[0-9]{3}"), [EOS])
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    matchers.apply_bitmask(logits, {"free": 0, "digits": 1, "other": 2})
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)
    assert EOS not in allowed  # the grammar cannot end before three digits


def test_matchers_advance_end_only_at_the_grammar_end_and_roll_back(compiler, tokenizer):
    matchers = GrammarMatchers(compiler, max_num_reqs=2)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    tokens = _encode(tokenizer, "yes")
    matchers.add_request("r", spec, [EOS])
    assert matchers.accept_tokens("r", tokens) == len(tokens)

    def allowed():
        logits = torch.zeros(1, VOCAB)
        matchers.apply_bitmask(logits, {"r": 0})
        return torch.isfinite(logits[0]).nonzero().flatten().tolist()

    assert allowed() == [EOS]  # complete: only the end token
    assert matchers.accept_tokens("r", [EOS]) == 1
    matchers.rollback("r", len(tokens) + 1)
    assert EOS not in allowed()
    assert matchers.accept_tokens("r", _encode(tokenizer, "maybe")) == 0


def test_a_resumed_request_replays_its_outputs(compiler, tokenizer):
    matchers = GrammarMatchers(compiler, max_num_reqs=1)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    done = _encode(tokenizer, '{"n": 12')
    matchers.add_request("r", spec, [EOS], done)
    assert matchers.accept_tokens("r", _encode(tokenizer, "}")) == 1
    json.loads(tokenizer.decode(done + _encode(tokenizer, "}")))


def _allowed(logits_row):
    return torch.isfinite(logits_row).nonzero().flatten().tolist()


def test_each_draft_position_gets_the_mask_after_the_drafts_before_it(compiler, tokenizer):
    matchers = GrammarMatchers(compiler, max_num_reqs=2, num_speculative_tokens=3)
    spec = StructuredOutputsParams(regex="[0-9]{3}")
    matchers.add_request("digits", spec, [EOS])
    drafts = _encode(tokenizer, "12")
    # Logits rows: the free request's one row, then "digits" at its 3 verified positions.
    logits = torch.zeros(4, VOCAB)
    first_rows = np.array([0, 1])
    matchers.apply_bitmask_with_drafts(
        logits, {"free": 0, "digits": 1}, first_rows, {"digits": drafts}
    )
    assert _allowed(logits[0]) == list(range(VOCAB))
    reference = GrammarMatchers(compiler, max_num_reqs=1)
    reference.add_request("digits", spec, [EOS])
    for j in range(len(drafts) + 1):
        want = torch.zeros(1, VOCAB)
        reference.apply_bitmask(want, {"digits": 0})
        assert _allowed(logits[1 + j]) == _allowed(want[0])
        if j < len(drafts):
            reference.accept_tokens("digits", drafts[j : j + 1])
    # The matcher is where it was: three more digits, no fewer, end the grammar.
    assert matchers.accept_tokens("digits", [*_encode(tokenizer, "123"), EOS]) == len(drafts) + 2


def test_positions_after_a_refused_draft_are_left_unmasked(compiler, tokenizer):
    matchers = GrammarMatchers(compiler, max_num_reqs=1, num_speculative_tokens=3)
    matchers.add_request("r", StructuredOutputsParams(regex="[0-9]{3}"), [EOS])
    drafts = _encode(tokenizer, "1") + _encode(tokenizer, "x") + _encode(tokenizer, "2")
    logits = torch.zeros(4, VOCAB)
    matchers.apply_bitmask_with_drafts(logits, {"r": 0}, np.array([0]), {"r": drafts})
    assert drafts[1] not in _allowed(logits[1])  # the refused draft has probability 0
    assert _allowed(logits[2]) == _allowed(logits[3]) == list(range(VOCAB))


def test_proposed_drafts_are_cut_at_the_first_token_the_grammar_refuses(compiler, tokenizer):
    matchers = GrammarMatchers(compiler, max_num_reqs=2)
    matchers.add_request("r", StructuredOutputsParams(choice=["yes", "no"]), [EOS])
    yes = _encode(tokenizer, "yes")
    drafts = [[5, 6, 7], [*yes, EOS, 9]]
    matchers.cut_drafts({"free": 0, "r": 1}, drafts)
    assert drafts == [[5, 6, 7], [*yes, EOS]]  # nothing follows the grammar's end
    assert matchers.accept_tokens("r", _encode(tokenizer, "no")) > 0  # not advanced
