"""``--tool-call-parser`` llama3_json, mistral and qwen3_xml over HTTP: a grammar makes the model
write a call in the parser's format, and the chat answer carries it as ``tool_calls``, whole and
streamed (the call in one piece)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from chat_tools import SCHEMA_OF, TOOLS, tools_tokenizer
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs

MODEL = "tiny-llama"
CITY = "[a-z]{1,8}"
ARGS = '{\\"city\\": \\"" ' + CITY + ' "\\", \\"unit\\": \\"celsius\\"}'
# parser -> (grammar of an output holding one get_weather call, the text beside the call)
FORMATS = {
    "qwen3_xml": (
        'root ::= "Let me check. <tool_call>\\n<function=get_weather>\\n<parameter=city>\\n" '
        + CITY
        + ' "\\n</parameter>\\n<parameter=unit>\\ncelsius\\n</parameter>\\n</function>\\n'
        '</tool_call>"',
        "Let me check. ",
    ),
    "mistral": (
        'root ::= "Let me check. [TOOL_CALLS][{\\"name\\": \\"get_weather\\", \\"arguments\\": '
        + ARGS
        + '}]"',
        "Let me check. ",
    ),
    "llama3_json": (
        'root ::= "{\\"name\\": \\"get_weather\\", \\"parameters\\": ' + ARGS + '}"',
        None,
    ),
}


@pytest.fixture(
    scope="module",
    params=[
        "qwen3_xml",
        pytest.param("mistral", marks=pytest.mark.slow),
        pytest.param("llama3_json", marks=pytest.mark.slow),
    ],
)
def parser_server(request, tiny_model, test_tokenizer_path, tmp_path_factory):
    tokenizer = tools_tokenizer(test_tokenizer_path, tmp_path_factory.mktemp("tools-tokenizer"))
    args = EngineArgs(
        model=str(tiny_model("llama")),
        tokenizer=str(tokenizer),
        max_model_len=1024,
        kv_cache_memory=16 * 1024**2,
        served_model_name=MODEL,
    )
    with ServerThread(args, tool_call_parser=request.param) as running:
        yield request.param, running


def test_calls_in_the_parsers_format_become_tool_calls(parser_server):
    name, server = parser_server
    grammar, content = FORMATS[name]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        max_tokens=300,
        temperature=0.0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == content
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF["get_weather"])
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    pieces = [p for d in deltas for p in d.tool_calls or []]
    (piece,) = pieces  # the call in one piece: its name and arguments whole
    assert (piece.function.name, piece.function.arguments) == (
        "get_weather",
        call.function.arguments,
    )
    assert "".join(d.content or "" for d in deltas) == (content or "")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
