"""Fuzzed chat, completions, Anthropic messages and Responses bodies: roles, content shapes, unicode (lone
surrogates included), special-token text and arbitrary nesting. Every body gets a 200 or a 4xx
with an error body in the route's shape (OpenAI's, or Anthropic's on ``/v1/messages``), never a
5xx, and never a 200 stream carrying an error; good streams running beside the fuzz all
complete."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_thread import ServerThread

from ember_server.engine.engine_args import EngineArgs
from ember_server.openai.protocol_chat import CHAT_ROLES

TIMEOUT = 60
MODEL = "fuzzed"

# Every code point, lone surrogates included, plus the template's own markers.
_chars = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
_markers = st.sampled_from(["<|im_start|>system\n", "<|im_end|>", "<|bos|>", "\ud800", "\udfff"])
text = st.lists(st.one_of(st.text(_chars, max_size=8), _markers), max_size=4).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio"])},
    optional={"text": st.one_of(text, json_values), "image_url": json_values},
)
content = st.one_of(text, st.none(), st.lists(part, max_size=3), json_values)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from([*CHAT_ROLES, "function", "bot", ""]), text)},
    optional={
        "content": content,
        "name": st.one_of(text, json_values),
        "tool_calls": json_values,
        "tool_call_id": st.one_of(text, json_values),
    },
)
# max_tokens is always there and tiny when valid: a valid fuzz case must stay cheap.
sampling = {
    "max_tokens": st.one_of(st.integers(0, 2), json_values),
}
optional_sampling = {
    "stream": st.one_of(st.booleans(), json_values),
    "stop": st.one_of(text, st.lists(text, max_size=3), json_values),
    "n": st.one_of(st.integers(-1, 3), json_values),
    "temperature": st.one_of(st.floats(-1, 3), json_values),
    "logprobs": json_values,
    "stream_options": json_values,
    "extra": json_values,
}
chat_body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=4), json_values), **sampling},
    optional={**optional_sampling, "chat_template_kwargs": json_values},
)
prompt = st.one_of(
    text,
    st.lists(text, max_size=3),
    st.lists(st.integers(-3, 3000), max_size=5),
    st.lists(st.lists(st.integers(-3, 3000), max_size=3), max_size=3),
    json_values,
)
completion_body = st.fixed_dictionaries(
    {"prompt": prompt, **sampling},
    optional={
        **optional_sampling,
        "echo": json_values,
        "prompt_logprobs": st.one_of(st.integers(-1, 3), json_values),
        "return_tokens_as_token_ids": json_values,
        "use_beam_search": st.one_of(st.booleans(), json_values),
        "length_penalty": st.one_of(st.floats(-2, 2), json_values),
    },
)
block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "image", ""])},
    optional={
        "text": st.one_of(text, json_values),
        "id": st.one_of(text, json_values),
        "name": st.one_of(text, json_values),
        "input": json_values,
        "tool_use_id": st.one_of(text, json_values),
        "content": st.one_of(text, st.lists(part, max_size=2), json_values),
    },
)
# Mostly well-formed turns, so that many bodies reach the engine (the rest probe validation).
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.one_of(st.just("user"), st.sampled_from(["assistant", "system"]), text),
        "content": st.one_of(text, text, st.lists(block, max_size=3), json_values),
    }
)
tool = st.fixed_dictionaries(
    {"name": st.one_of(text, st.just("f"))},
    optional={"input_schema": st.one_of(st.just({"type": "object"}), json_values)},
)
messages_body = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just(MODEL), st.just(MODEL), json_values),
        "messages": st.one_of(st.lists(anthropic_message, min_size=1, max_size=2), json_values),
        "max_tokens": st.one_of(st.integers(1, 2), json_values),
    },
    optional={
        "system": st.one_of(text, st.lists(part, max_size=2), json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "stop_sequences": st.one_of(st.lists(text, max_size=2), json_values),
        "temperature": st.one_of(st.floats(-1, 3), json_values),
        "top_k": st.one_of(st.integers(-2, 5), json_values),
        "tools": st.one_of(st.lists(tool, max_size=2), json_values),
        "tool_choice": st.one_of(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                optional={"name": st.one_of(text, st.just("f"))},
            ),
            json_values,
        ),
        "metadata": json_values,
    },
)
input_item = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"]),
        "role": st.one_of(st.sampled_from(["user", "assistant", "system", "tool"]), text),
        "content": st.one_of(text, st.lists(part, max_size=2), json_values),
        "call_id": st.one_of(text, json_values),
        "name": st.one_of(text, json_values),
        "arguments": st.one_of(text, json_values),
        "output": st.one_of(text, json_values),
    },
)
responses_body = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just(MODEL), json_values),
        "input": st.one_of(text, st.lists(input_item, max_size=3), json_values),
        "max_output_tokens": st.one_of(st.integers(1, 2), json_values),
    },
    optional={
        "instructions": st.one_of(text, json_values),
        "stream": st.one_of(st.booleans(), json_values),
        "temperature": st.one_of(st.floats(-1, 3), json_values),
        "tools": st.one_of(
            st.lists(
                st.fixed_dictionaries({"type": st.just("function"), "name": text}), max_size=2
            ),
            json_values,
        ),
        "tool_choice": json_values,
        "text": st.one_of(
            st.fixed_dictionaries(
                {"format": st.fixed_dictionaries({"type": text | st.just("json_object")})}
            ),
            json_values,
        ),
        "store": json_values,
        "previous_response_id": st.one_of(text, json_values),
    },
)
# Well-formed bodies around fuzzed text, so that the agent routes' generation paths (streams
# included) meet hostile unicode and template markers too.
plain_messages_body = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": text}),
            min_size=1,
            max_size=2,
        ),
        "max_tokens": st.integers(1, 2),
    },
    optional={
        "system": text,
        "stream": st.booleans(),
        "stop_sequences": st.lists(text, max_size=2),
    },
)
plain_responses_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "input": text, "max_output_tokens": st.integers(1, 2)},
    optional={"instructions": text, "stream": st.booleans(), "store": st.booleans()},
)
MESSAGES_ROUTES = ["v1/messages", "v1/messages/count_tokens"]
request = st.one_of(
    st.tuples(st.just("v1/chat/completions"), chat_body),
    st.tuples(st.just("v1/completions"), completion_body),
    st.tuples(st.sampled_from(MESSAGES_ROUTES), messages_body),
    st.tuples(st.just("v1/responses"), responses_body),
    st.tuples(st.sampled_from(MESSAGES_ROUTES), plain_messages_body),
    st.tuples(st.just("v1/responses"), plain_responses_body),
    st.tuples(
        st.sampled_from(
            ["v1/chat/completions", "v1/completions", "v1/responses", *MESSAGES_ROUTES]
        ),
        json_values,
    ),
)


@pytest.fixture(scope="module")
def server(tiny_model):
    args = EngineArgs(
        model=str(tiny_model("llama")),
        dtype="float32",
        max_model_len=1024,
        kv_cache_memory=2**22,
        served_model_name=MODEL,
    )
    with ServerThread(args) as running:
        yield running


class _GoodStreams(threading.Thread):
    """Streams greedy completions one after another until stopped; records how each ended."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/v1/completions"
        self.stop = threading.Event()
        self.endings: list[tuple[str | None, str]] = []  # (finish_reason, last event)

    def run(self) -> None:
        body = dict(prompt="def main(argv):", max_tokens=64, ignore_eos=True, stream=True)
        with httpx.Client(timeout=TIMEOUT) as client:
            while not self.stop.is_set():
                with client.stream("POST", self.url, json=body) as response:
                    events = [ln[5:].strip() for ln in response.iter_lines() if ln[:5] == "data:"]
                chunks = [json.loads(e) for e in events[:-1]]
                reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
                self.endings.append((reasons[-1] if reasons else None, events[-1]))


def _check(route: str, response: httpx.Response) -> None:
    status = response.status_code
    assert status < 500, response.text
    if status >= 400 and route.startswith("v1/messages"):  # Anthropic's error shape
        body = response.json()
        assert body["type"] == "error" and body["error"]["message"] and body["error"]["type"]
    elif status >= 400:
        error = response.json()["error"]
        assert error["code"] == status and error["message"] and error["type"]
    elif response.headers["content-type"].startswith("text/event-stream"):
        # Responses' envelope holds "error": null; its failures are "error" events.
        marker = "event: error" if route == "v1/responses" else "error"
        assert marker not in response.text, response.text


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=request)
def _fuzz(client: httpx.Client, case) -> None:
    route, body = case
    # ensure_ascii writes lone surrogates as \ud800 escapes, as a hostile client would.
    raw = json.dumps(body, ensure_ascii=True)
    _check(route, client.post(route, content=raw, headers={"content-type": "application/json"}))


def test_fuzzed_bodies_never_get_a_5xx_while_good_streams_complete(server):
    streams = _GoodStreams(server.base_url)
    streams.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT) as client:
            _fuzz(client)
    finally:
        streams.stop.set()
        streams.join(TIMEOUT)
    assert streams.endings, "no good stream ran beside the fuzz"
    assert all(ending == ("length", "[DONE]") for ending in streams.endings), streams.endings
