"""Anthropic's Messages API (``/v1/messages``) through the official ``anthropic`` client, checked
against the same conversation's chat completion."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from chat_tools import SCHEMA_OF, TOOLS, tools_tokenizer
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs

MODEL = "tiny-llama"
API_KEY = "anthropic-key"
SYSTEM = "Be brief."
USER = [{"role": "user", "content": "What is the weather in Köln?"}]
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
# The client has no sampling arguments (temperature, top_p, top_k): they go in the body.
GREEDY = {"temperature": 0.0}
HERMES_GRAMMAR = (
    'root ::= "Let me check. <tool_call>{\\"name\\": \\"get_weather\\", '
    '\\"arguments\\": {\\"city\\": \\"" [a-z]{1,8} "\\", \\"unit\\": \\"celsius\\"}}</tool_call>"'
)


@pytest.fixture(scope="module")
def server(tiny_model, test_tokenizer_path, tmp_path_factory):
    tokenizer = tools_tokenizer(test_tokenizer_path, tmp_path_factory.mktemp("tools-tokenizer"))
    args = EngineArgs(
        model=str(tiny_model("llama")),
        tokenizer=str(tokenizer),
        max_model_len=1024,
        kv_cache_memory=16 * 1024**2,
        served_model_name=MODEL,
    )
    with ServerThread(args, api_key=API_KEY, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def chat(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def _chat_messages() -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, *USER]


def test_create_equals_the_chat_completion(client, chat):
    expected = chat.chat.completions.create(
        model=MODEL, messages=_chat_messages(), max_tokens=12, temperature=0.0
    )
    message = client.messages.create(
        model=MODEL, system=SYSTEM, messages=USER, max_tokens=12, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    (block,) = message.content
    assert block.type == "text" and block.text == expected.choices[0].message.content
    reason = {"length": "max_tokens", "stop": "end_turn"}[expected.choices[0].finish_reason]
    assert message.stop_reason == reason and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert usage.cache_read_input_tokens > 0  # the chat request just computed the same prompt
    assert usage.output_tokens == expected.usage.completion_tokens


def test_stream_sends_anthropics_events_and_the_same_message(client, server):
    kwargs = dict(model=MODEL, system=SYSTEM, messages=USER, max_tokens=12, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[:3] == ["message_start", "content_block_start", "content_block_delta"]
    assert "text" in kinds  # the client's own event for each text delta
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    # The raw stream names each event and pings once after message_start.
    body = {**kwargs, **GREEDY, "stream": True}
    del body["extra_body"]
    headers = {"x-api-key": API_KEY}
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json=body, headers=headers) as r:
        names = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_forced_tool_use_validates_against_the_tool_schema(client, stream):
    choices = [{"type": "tool", "name": t["name"]} for t in ANTHROPIC_TOOLS] + [{"type": "any"}]
    for i, choice in enumerate(choices):
        kwargs = dict(
            model=MODEL,
            messages=USER,
            tools=ANTHROPIC_TOOLS,
            tool_choice=choice,
            max_tokens=400,
            extra_body={"temperature": 1.0 if i % 2 else 0.0},
        )
        if stream:
            with client.messages.stream(**kwargs) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**kwargs)
        assert message.stop_reason == "tool_use"
        (block,) = message.content
        assert block.type == "tool_use" and block.id.startswith("toolu_")
        if choice["type"] == "tool":
            assert block.name == choice["name"]
        jsonschema.validate(block.input, SCHEMA_OF[block.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_tool_choice_parses_calls_and_stop_sequences_end_text(client, stream):
    """A grammar makes the model write a Hermes call; the server's parser turns it into a
    tool_use block after the text. A stop sequence inside that text ends it instead."""
    kwargs = dict(
        model=MODEL,
        messages=USER,
        tools=ANTHROPIC_TOOLS,
        max_tokens=200,
        extra_body={"structured_outputs": {"grammar": HERMES_GRAMMAR}},
    )

    def create(**more):
        if not stream:
            return client.messages.create(**kwargs, **more)
        with client.messages.stream(**kwargs, **more) as events:
            return events.get_final_message()

    message = create()
    assert message.stop_reason == "tool_use"
    text, call = message.content
    assert text.type == "text" and text.text.strip() == "Let me check."
    assert call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, SCHEMA_OF["get_weather"])
    stopped = create(stop_sequences=["check"])
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "check")
    assert [b.text for b in stopped.content] == ["Let me "]


def test_tool_results_reach_the_template_and_count_tokens_matches(client, chat, server):
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Köln"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "12 degrees"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    counted = client.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=messages, tools=ANTHROPIC_TOOLS
    )
    chat_messages = [
        *_chat_messages(),
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Köln"})},
                }
            ],
        },
        {"role": "tool", "content": "12 degrees", "tool_call_id": "t1"},
        {"role": "user", "content": "Thanks"},
    ]
    with_tools = chat.chat.completions.create(
        model=MODEL, messages=chat_messages, tools=TOOLS, tool_choice="required", max_tokens=1
    )
    assert counted.input_tokens == with_tools.usage.prompt_tokens
    tokenized = httpx.post(
        f"{server.base_url}/tokenize",
        json={"model": MODEL, "messages": chat_messages},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    plain = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert plain.input_tokens == tokenized["count"] < counted.input_tokens
    reply = client.messages.create(
        model=MODEL, system=SYSTEM, messages=messages, max_tokens=3, extra_body=GREEDY
    )
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == plain.input_tokens


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"messages": USER, "max_tokens": 4}, 400, "model"),
        ({"model": MODEL, "messages": USER}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [], "max_tokens": 4}, 400, "messages"),
        ({"model": MODEL, "messages": USER, "max_tokens": "4"}, 400, "max_tokens"),
        ({"model": "other", "messages": USER, "max_tokens": 4}, 404, "other"),
        ({"model": MODEL, "messages": USER, "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": MODEL, "messages": USER, "max_tokens": 4, "temperature": -1.0}, 400, "temp"),
        (
            {"model": MODEL, "messages": USER, "max_tokens": 4, "tool_choice": {"type": "any"}},
            400,
            "tool_choice",
        ),
        (
            {
                "model": MODEL,
                "messages": USER,
                "max_tokens": 4,
                "tools": ANTHROPIC_TOOLS,
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            400,
            "nope",
        ),
        (
            {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x"}]}],
            },
            400,
            "messages",
        ),
    ],
)
def test_bad_requests_get_anthropic_errors(server, body, status, needle):
    headers = {"x-api-key": API_KEY}
    response = httpx.post(f"{server.base_url}/v1/messages", json=body, headers=headers)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and needle in error["error"]["message"]
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert error["error"]["type"] == kind


def test_api_key_is_read_from_either_header(server, client):
    url = f"{server.base_url}/v1/messages/count_tokens"
    body = {"model": MODEL, "messages": USER}
    missing = httpx.post(url, json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    bearer = httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=USER)
    # The OpenAI routes keep OpenAI's error shape.
    chat_missing = httpx.post(f"{server.base_url}/v1/chat/completions", json={})
    assert chat_missing.json()["error"]["code"] == 401
