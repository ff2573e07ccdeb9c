"""The tool-call parsers beside hermes: whole outputs, and streams cut at every point, where a
call goes out only whole (never a partial name or broken JSON)."""

from __future__ import annotations

import itertools
import json

import pytest

from ember_server.openai.protocol_chat import ChatTool
from ember_server.openai.tool_calls import TOOL_CALL_PARSERS, ParsedCallStream

TOOLS = [
    ChatTool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    )
]
QWEN_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
CASES = [
    # (parser, text, expected content, expected calls as (name, arguments))
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Köln", "days": 3}}',
        None,
        [("get_weather", {"city": "Köln", "days": 3})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1]}}',
        None,
        [("a", {}), ("b", {"x": [1]})],
    ),
    ("llama3_json", "It is {sunny} today.", "It is {sunny} today.", []),
    (
        "llama3_json",
        '{"name": "a", "parameters": {"x": 1',
        '{"name": "a", "parameters": {"x": 1',
        [],
    ),
    (
        "mistral",
        'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Köln"}}]',
        "Checking. ",
        [("get_weather", {"city": "Köln"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": "{\\"x\\": 2}"}, {"name": "b", "arguments": {}}]',
        None,
        [("a", {"x": 2}), ("b", {})],
    ),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    (
        "qwen3_xml",
        f"Let me check. {QWEN_CALL}",
        "Let me check. ",
        [("get_weather", {"city": "Köln", "days": 3})],
    ),
    ("qwen3_xml", "<tool_call>oops</tool_call> hi", "<tool_call>oops</tool_call> hi", []),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_whole_output_and_every_streamed_cut(name, text, content, calls):
    parser = TOOL_CALL_PARSERS[name]()
    whole_content, whole_calls = parser.parse(text, TOOLS)
    assert (whole_content, _calls(whole_calls)) == (content, calls)
    for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        stream = ParsedCallStream(parser, TOOLS)
        deltas = [stream.feed(piece) for piece in (text[:a], text[a:b], text[b:])]
        tail, finish = stream.finish("stop")
        deltas.append(tail)
        streamed_content = "".join(d.content or "" for d in deltas if d is not None)
        pieces = [c for d in deltas if d is not None for c in d.tool_calls or []]
        for piece in pieces:  # each call whole: its id, name and parseable arguments at once
            assert piece.id and piece.function.name
            assert isinstance(json.loads(piece.function.arguments), dict)
        assert [p.index for p in pieces] == list(range(len(calls)))
        assert streamed_content == (content or "")
        assert [(p.function.name, json.loads(p.function.arguments)) for p in pieces] == calls
        assert finish == ("tool_calls" if calls else "stop")
