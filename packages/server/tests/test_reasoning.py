"""The reasoning parsers: whole outputs and every way a stream can break them into chunks."""

from __future__ import annotations

import itertools

import pytest

from ember_server.openai.reasoning import REASONING_PARSERS, reasoning_parser

CASES = {
    # text: (deepseek_r1's split, qwen3's split)
    "<think>plan it</think>The answer.": (("plan it", "The answer."), ("plan it", "The answer.")),
    "plan it</think>The answer.": (
        ("plan it", "The answer."),
        (None, "plan it</think>The answer."),
    ),
    "The answer.": (("The answer.", ""), (None, "The answer.")),
    "<think>still thinking": (("still thinking", ""), ("still thinking", "")),
    "<thin": (("<thin", ""), (None, "<thin")),
    "<think></think>": ((None, ""), (None, "")),
    "<think>a</thi": (("a</thi", ""), ("a</thi", "")),
    "<think>a < b </ c</think>x</think>": (
        ("a < b </ c", "x</think>"),
        ("a < b </ c", "x</think>"),
    ),
}


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", list(CASES))
def test_whole_and_every_two_and_three_way_chunking_split_alike(name, text):
    parser = reasoning_parser(name)
    expected = CASES[text][sorted(REASONING_PARSERS).index(name)]
    assert parser.split(text) == expected
    cuts = range(len(text) + 1)
    for a, b in itertools.combinations_with_replacement(cuts, 2):
        stream = parser.stream()
        reasoning, content = "", ""
        for chunk in (text[:a], text[a:b], text[b:]):
            r, c = stream.feed(chunk)
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert ((reasoning + r) or None, content + c) == expected, (a, b)


def test_unknown_parser_names_the_setting():
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        reasoning_parser("nope")
