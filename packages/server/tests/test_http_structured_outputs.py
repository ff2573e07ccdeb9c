"""Structured outputs and tool calls through the official openai client, streamed and not."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from chat_tools import SCHEMA_OF, TOOLS, tools_tokenizer
from server_thread import ServerThread
from structured_cases import CHOICES, REGEXES, SCHEMAS, matches_regex

from ember_server.engine.engine_args import EngineArgs
from ember_server.openai.protocol_chat import ChatCompletionRequest
from ember_server.openai.tool_calls import (
    HermesToolParser,
    ParsedCallStream,
    RequiredCallStream,
    forced_tool_call,
)

MODEL = "tiny-llama"
MAX_TOKENS = 400
CHAT = [{"role": "user", "content": "What is the weather in Köln?"}]


@pytest.fixture(scope="module")
def server(tiny_model, test_tokenizer_path, tmp_path_factory):
    tokenizer = tools_tokenizer(test_tokenizer_path, tmp_path_factory.mktemp("tools-tokenizer"))
    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        tokenizer=str(tokenizer),
        max_model_len=1024,
        max_num_seqs=64,
        kv_cache_memory=32 * 1024**2,
        served_model_name=MODEL,
    )
    with ServerThread(args, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def client(server, loop) -> openai.AsyncOpenAI:
    # Retries: a kept-alive connection idle between tests may have been closed by the server
    # (uvicorn's keep-alive is 5 s), which the client sees as a connection error.
    client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=2)
    yield client
    loop.run_until_complete(client.close())


def _sampling(index: int) -> dict:
    """Greedy and seeded sampling alternate, so both paths meet every grammar."""
    return {"temperature": 0.0 if index % 2 else 1.0, "seed": index, "max_tokens": MAX_TOKENS}


async def _chat(client, stream: bool, **body) -> tuple[str, str, list]:
    """``(content, finish_reason, tool calls as (name, arguments))`` of one chat completion."""
    if not stream:
        response = await client.chat.completions.create(model=MODEL, **body)
        choice = response.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content or "", choice.finish_reason, calls
    content, finish, calls = "", None, {}
    async for chunk in await client.chat.completions.create(model=MODEL, stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:  # the first piece of a call: id, type and name
                    assert piece.type == "function" and piece.function.name
                    calls[piece.index] = [piece.function.name, ""]
                calls[piece.index][1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, finish, [tuple(calls[i]) for i in sorted(calls)]


async def _complete(client, stream: bool, **body) -> tuple[str, str]:
    if not stream:
        response = await client.completions.create(model=MODEL, prompt="import os", **body)
        return response.choices[0].text, response.choices[0].finish_reason
    text, finish = "", None
    async for chunk in await client.completions.create(
        model=MODEL, prompt="import os", stream=True, **body
    ):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def _run(loop, coroutines):
    """Run the requests side by side (they share engine steps) on the client's loop."""

    async def gather():
        return await asyncio.gather(*coroutines)

    return loop.run_until_complete(gather())


def _json_schema_format(schema: dict, index: int) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": f"s{index}", "schema": schema, "strict": True},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema_on_chat_and_completions(client, loop, stream):
    chats = [
        _chat(
            client, stream, messages=CHAT, response_format=_json_schema_format(s, i), **_sampling(i)
        )
        for i, s in enumerate(SCHEMAS)
    ]
    completions = [
        # The client's completions method has no response_format argument: vLLM's way.
        _complete(
            client,
            stream,
            extra_body={"response_format": _json_schema_format(s, i)},
            **_sampling(i + 1),
        )
        for i, s in enumerate(SCHEMAS)
    ]
    results = _run(loop, chats + completions)
    for schema, (text, finish, *_) in zip(SCHEMAS * 2, results):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_outputs_extra_body_regex_choice_and_json_object(client, loop, stream):
    names = list(REGEXES) * 2
    regexes = [
        _complete(
            client, stream, extra_body={"structured_outputs": {"regex": REGEXES[n]}}, **_sampling(i)
        )
        for i, n in enumerate(names)
    ]
    choices = [
        _chat(
            client,
            stream,
            messages=CHAT,
            extra_body={"structured_outputs": {"choice": c}},
            **_sampling(i),
        )
        for i, c in enumerate(CHOICES * 2)
    ]
    schema = _complete(
        client, stream, extra_body={"structured_outputs": {"json": SCHEMAS[12]}}, **_sampling(1)
    )
    json_object = _chat(
        client, stream, messages=CHAT, response_format={"type": "json_object"}, **_sampling(1)
    )
    results = _run(loop, [*regexes, *choices, schema, json_object])
    for name, (text, finish) in zip(names, results):
        assert finish == "stop" and matches_regex(name, text), (name, text)
    for options, (text, finish, _) in zip(CHOICES * 2, results[len(names) :]):
        assert finish == "stop" and text in options
    jsonschema.validate(json.loads(results[-2][0]), SCHEMAS[12])
    text, finish, _ = results[-1]
    assert finish == "stop" and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_tool_calls_validate_against_the_tool_schema(client, loop, stream):
    named = [{"type": "function", "function": {"name": tool["function"]["name"]}} for tool in TOOLS]
    requests = [
        _chat(client, stream, messages=CHAT, tools=TOOLS, tool_choice=choice, **_sampling(i))
        for i, choice in enumerate(["required"] * 6 + named * 2)
    ]
    for i, (content, finish, calls) in enumerate(_run(loop, requests)):
        assert finish == "tool_calls" and content == ""
        ((name, arguments),) = calls
        if i >= 6:
            assert name == named[(i - 6) % len(named)]["function"]["name"]
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_parses_hermes_calls_out_of_the_text(client, loop, stream):
    """The model is made to write a Hermes block (by a grammar), then the parser finds it."""
    grammar = (
        'root ::= "Let me check. <tool_call>{\\"name\\": \\"get_weather\\", '
        '\\"arguments\\": {\\"city\\": \\"" [a-z]{1,8} "\\", \\"unit\\": \\"celsius\\"}}</tool_call>"'
    )
    body = {
        "messages": CHAT,
        "tools": TOOLS,
        "extra_body": {"structured_outputs": {"grammar": grammar}},
    }
    results = _run(loop, [_chat(client, stream, **body, **_sampling(i)) for i in range(4)])
    for content, finish, calls in results:
        assert finish == "tool_calls"
        assert content.strip() == "Let me check."
        ((name, arguments),) = calls
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])


def test_tools_reach_the_chat_template(client, loop):
    async def prompt_tokens(**body):
        response = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=1, **body
        )
        return response.usage.prompt_tokens

    plain, with_tools, tools_off = _run(
        loop,
        [
            prompt_tokens(),
            prompt_tokens(tools=TOOLS, tool_choice="required"),
            prompt_tokens(tools=TOOLS, tool_choice="none"),
        ],
    )
    assert with_tools > plain == tools_off


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}},
            "structured_outputs",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
            "structured_outputs",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_bad_specs_are_400s_naming_the_field(client, loop, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        _run(
            loop, [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **body)]
        )
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == param, caught.value.body


def test_the_server_keeps_serving_after_bad_specs(client, loop):
    ((text, finish, _),) = _run(
        loop,
        [
            _chat(
                client,
                False,
                messages=CHAT,
                extra_body={"structured_outputs": {"choice": ["ok"]}},
                max_tokens=8,
            )
        ],
    )
    assert (text, finish) == ("ok", "stop")


def test_hermes_parser_keeps_text_and_skips_broken_blocks():
    parser = HermesToolParser()
    text = 'Hi <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and <tool_call>oops</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Hi  and <tool_call>oops</tool_call>"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("f", {"x": 1})]
    assert parser.parse("no calls") == ("no calls", [])


def test_parsed_call_stream_holds_back_a_possible_block_start():
    stream = ParsedCallStream(HermesToolParser())
    pieces = ["Hi <tool", '_call>{"name": "f", ', '"arguments": {}}</tool_call>', " bye <", "tool"]
    deltas = [stream.feed(piece) for piece in pieces]
    assert deltas[0].content == "Hi " and deltas[1] is None
    assert deltas[2].tool_calls[0].function.name == "f" and deltas[2].content is None
    assert deltas[3].content == " bye " and deltas[4] is None
    tail, finish = stream.finish("stop")
    assert tail.content == "<tool" and finish == "tool_calls"


def test_a_required_call_cut_short_by_a_stop_string_stays_text():
    request = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "tools": TOOLS, "tool_choice": "required"}
    )
    cut = '{"name": "add", "argu'
    assert forced_tool_call(request, cut) is None
    stream = RequiredCallStream(request)
    assert stream.feed(cut) is None
    tail, finish = stream.finish("stop")
    assert (tail.content, tail.tool_calls, finish) == (cut, None, "stop")
