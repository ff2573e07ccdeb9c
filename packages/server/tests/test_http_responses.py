"""OpenAI's Responses API (``/v1/responses``) through the official ``openai`` client's
``client.responses``, checked against the same conversation's chat completion."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from chat_tools import SCHEMA_OF, TOOLS, tools_tokenizer
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs
from ember_server.openai.serving_responses import ResponseStore

MODEL = "tiny-llama"
SYSTEM = "Be brief."
QUESTION = "What is the weather in Köln?"
FUNCTIONS = [{"type": "function", **t["function"]} for t in TOOLS]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


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
    with ServerThread(args, tool_call_parser="hermes") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _chat_text(client, messages, **kwargs) -> tuple[str, str]:
    choice = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, **kwargs
    ).choices[0]
    return choice.message.content, choice.finish_reason


def _stream(client, **kwargs) -> tuple[list, object]:
    """The stream's events and the response of its last event."""
    events = list(client.responses.create(model=MODEL, stream=True, **kwargs))
    return events, events[-1].response


def test_text_equals_the_chat_completion_whole_and_streamed(client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    expected, finish = _chat_text(client, messages, max_tokens=12)
    kwargs = dict(instructions=SYSTEM, input=QUESTION, max_output_tokens=12, temperature=0.0)
    response = client.responses.create(model=MODEL, **kwargs)
    assert response.object == "response" and response.model == MODEL
    assert response.output_text == expected
    assert response.status == ("incomplete" if finish == "length" else "completed")
    assert response.usage.output_tokens == 12 or finish == "stop"
    assert response.usage.input_tokens_details.cached_tokens > 0  # the chat computed the prompt
    events, final = _stream(client, **kwargs)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{response.status}",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == expected == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    items = client.responses.create(
        model=MODEL,
        input=[
            {"role": "system", "content": SYSTEM},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": QUESTION}],
            },
        ],
        max_output_tokens=12,
        temperature=0.0,
    )
    assert items.output_text == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_format_json_schema_and_forced_function_calls(client, stream):
    def create(**kwargs):
        if stream:
            return _stream(client, **kwargs)[1]
        return client.responses.create(model=MODEL, **kwargs)

    structured = create(
        input=QUESTION,
        max_output_tokens=200,
        text={
            "format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}
        },
    )
    jsonschema.validate(json.loads(structured.output_text), SCHEMA)
    for i, choice in enumerate([{"type": "function", "name": "add"}, "required"]):
        response = create(
            input=QUESTION,
            tools=FUNCTIONS,
            tool_choice=choice,
            max_output_tokens=300,
            temperature=i,
        )
        (call,) = response.output
        assert call.type == "function_call" and call.call_id
        if i == 0:
            assert call.name == "add"
        jsonschema.validate(json.loads(call.arguments), SCHEMA_OF[call.name])


def test_streamed_function_call_arguments_arrive_as_deltas(client):
    events, final = _stream(
        client,
        input=QUESTION,
        tools=FUNCTIONS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=300,
        temperature=0.0,
    )
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (call,) = final.output
    assert deltas and "".join(deltas) == call.arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [d.arguments for d in done] == [call.arguments]


def test_previous_response_id_continues_the_stored_conversation(client, server):
    first = client.responses.create(
        model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=6, temperature=0.0
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow_up = client.responses.create(
        model=MODEL,
        instructions=SYSTEM,
        input="And tomorrow?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0.0,
    )
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"},
    ]
    expected, _ = _chat_text(client, messages, max_tokens=6)
    assert follow_up.output_text == expected
    assert follow_up.previous_response_id == first.id
    # A call and its output continue a conversation too.
    called = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=FUNCTIONS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=300,
    )
    (call,) = called.output
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees"}],
        max_output_tokens=4,
    )
    call_message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ],
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": QUESTION},
            call_message,
            {"role": "tool", "content": "12 degrees", "tool_call_id": call.call_id},
        ],
        max_tokens=1,
    )
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    unstored = client.responses.create(
        model=MODEL, input=QUESTION, max_output_tokens=2, store=False
    )
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    missing = httpx.post(
        f"{server.base_url}/v1/responses",
        json={"model": MODEL, "input": "x", "previous_response_id": "resp-nope"},
    )
    assert missing.status_code == 404
    assert missing.json()["error"]["param"] == "previous_response_id"


def test_the_store_forgets_the_least_recently_used_first():
    store = ResponseStore(capacity=2)
    for name in "abc":
        if name == "c":
            assert store.get("a") is not None  # a is now more recent than b
        store.put({"id": name}, [])
    assert store.get("b") is None and store.get("a") and store.get("c")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL}, 400, "input"),
        ({"model": MODEL, "input": 3}, 400, "input"),
        ({"model": "other", "input": "x"}, 404, "model"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 10**6}, 400, "max_tokens"),
        ({"model": MODEL, "input": "x", "tool_choice": "required"}, 400, "tool_choice"),
        ({"model": MODEL, "input": [{"type": "function_call_output"}]}, 400, "input"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "yaml"}}}, 400, "text"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, param):
    response = httpx.post(f"{server.base_url}/v1/responses", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and (error["param"] or "").startswith(param), error
