"""The OpenAI-compatible server under bad input (each case while a good request runs), arbitrary
bodies (hypothesis: never a 500, healthy after),
client disconnects (the request aborted, its KV blocks freed) and a bounded soak of mixed
requests (no leaked requests, blocks or engine memory), on its own server (``http_suite``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import pathlib
import random
import re
import socket
import time

import httpx
import openai
import pytest
from http_suite import API_KEY, AUTH, CHAT, MODEL_NAME, PROMPTS, client, engine_args, server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_thread import ServerThread

from ember_server.openai.sse import parse_sse

__all__ = ["client", "engine_args", "server"]  # fixtures, used by name


# --- bad input: every case gets its status and an OpenAI error body; a good request goes on ---

LONG_PROMPT = list(range(20, 220))  # 200 tokens, over the 128-token context
BAD_REQUESTS = [
    # (route, body or raw bytes, status, param or None)
    ("completions", b'{"model": "tiny-llama", "prompt": "x",', 400, None),
    ("completions", b"[1, 2, 3]", 400, None),
    ("completions", b"", 400, None),
    ("completions", {"model": MODEL_NAME}, 400, "prompt"),
    ("chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": 12}, 400, "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "presence_penalty": 9.0}, 400, "presence_penalty"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stream": True, "top_k": -5}, 400, "top_k"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (
        "completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("completions", {"prompt": LONG_PROMPT}, 400, "prompt"),
    ("completions", {"prompt": LONG_PROMPT, "stream": True}, 400, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 1000}, 400, "max_tokens"),
    ("completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    (
        "chat/completions",
        {"messages": CHAT, "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
    ),
    (
        "completions",
        {"prompt": "x", "response_format": {"type": "json_schema"}},
        400,
        "response_format",
    ),
    # This server has no --tool-call-parser: tool_choice auto (the default with tools) is a 400.
    (
        "chat/completions",
        {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tool_choice",
    ),
    ("completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": CHAT, "model": "gpt-4", "stream": True}, 404, "model"),
    ("nothing/here", {"prompt": "x"}, 404, None),
]


def test_bad_input_while_a_good_request_runs(server, client):
    good = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0.0)
    expected = client.completions.create(**good, extra_body={"ignore_eos": True})
    with httpx.Client(base_url=f"{server.base_url}/v1", headers=AUTH, timeout=60) as http:
        stream_body = {**good, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/completions", json=stream_body) as running:
            assert running.status_code == 200
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            for route, body, status, param in BAD_REQUESTS:
                if isinstance(body, bytes):
                    headers = {"content-type": "application/json"}
                    response = http.post(f"/{route}", content=body, headers=headers)
                else:
                    response = http.post(f"/{route}", json=body)
                assert response.status_code == status, (route, body, response.text)
                assert response.headers["content-type"].startswith("application/json")
                error = response.json()["error"]
                assert error["code"] == status and error["message"] and error["type"], error
                if param is not None:
                    assert error["param"] == param, (body, error)
            rest = [first, *lines]
    chunks = [line[5:].strip() for line in rest if line.startswith("data:")]
    assert chunks[-1] == "[DONE]"
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
    assert text == expected.choices[0].text
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_context_error_messages_say_what_is_wrong(server):
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": LONG_PROMPT}, headers=AUTH
    )
    assert "maximum context length is 128 tokens" in response.json()["error"]["message"]
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"prompt": "x", "model": "gpt-4"}, headers=AUTH
    )
    assert response.json()["error"]["message"] == "The model `gpt-4` does not exist."


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1.0)
    assert info.value.status_code == 400 and "temperature" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


_JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
# Valid values (the extremes included): the engine sees many of these bodies.
_PLAUSIBLE = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 5000),
    "seed": st.integers(-(2**63), 2**63 - 1) | st.integers(2**63, 2**70),  # too big: a 400
    "stop": st.text(min_size=1, max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 2047), max_size=2),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "min_tokens": st.integers(0, 1),
    "model": st.just(MODEL_NAME),
}
_PROMPTS = {
    "completions": st.text(max_size=12) | st.lists(st.integers(0, 2047), min_size=1, max_size=4),
    "chat/completions": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text()}
        ),
        min_size=1,
        max_size=2,
    ),
}
_OTHER_FIELDS = ["echo", "best_of", "logit_bias", "ignore_eos", "response_format", "tools",
                 "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
                 "suffix", "max_completion_tokens", "include_stop_str_in_output", "min_p",
                 "repetition_penalty", "max_tokens", "n", "frobnicate"]  # fmt: skip


def _maybe_one_junk_field(body: dict):
    """The body as is, or with one field set to arbitrary JSON (mostly-valid bodies reach the
    engine; a junk field checks one validation path at a time)."""
    junk = st.builds(
        lambda field, value: {**body, field: value},
        st.sampled_from([*_PLAUSIBLE, *_OTHER_FIELDS, "prompt", "messages"]),
        _JSON,
    )
    return st.just(body) | junk


def _bodies(route: str):
    prompt_field = "prompt" if route == "completions" else "messages"
    required = {"max_tokens": st.integers(1, 3), "n": st.integers(1, 2)}
    required[prompt_field] = _PROMPTS[route]
    valid = st.fixed_dictionaries(required, optional=_PLAUSIBLE)
    return valid.flatmap(_maybe_one_junk_field).map(lambda body: (route, body))


_REQUESTS = _bodies("completions") | _bodies("chat/completions")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_REQUESTS)
def test_any_body_gets_an_answer_never_a_500(server, request):
    route, body = request
    url = f"{server.base_url}/v1/{route}"
    with httpx.stream("POST", url, json=body, headers=AUTH, timeout=60) as response:
        text = response.read().decode()
    if response.status_code == 200:
        if body.get("stream") is True:
            events = parse_sse(text)
            assert events[-1] == "[DONE]"
            assert not any('"error"' in e for e in events[:-1]), events
        return
    assert response.status_code in (400, 404), (body, text)
    error = json.loads(text)["error"]
    assert error["code"] == response.status_code and error["message"], error


def test_server_is_healthy_after_the_fuzzing(server):
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    _assert_idle(server)


# --- client disconnects: the request is aborted and its KV blocks are freed ---


def _raw_request(server, path: str, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(head + payload)
    return sock


def _assert_idle(server) -> None:
    """No request left anywhere: KV usage and running/waiting gauges at zero, the scheduler's
    request map empty, and nothing in the front end (output processor, per-request queues)."""
    server.wait_for_metric("ember:kv_cache_usage_perc", lambda v: v == 0.0)
    assert server.metric("ember:num_requests_running") == 0
    assert server.metric("ember:num_requests_waiting") == 0
    assert server.engine.scheduler_stats.num_unfinished_reqs == 0
    assert server.engine.output_processor.get_num_unfinished_requests() == 0
    # A dropped stream's queue goes when its generator is closed, just after the abort.
    deadline = time.monotonic() + 10
    while server.engine._queues and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not server.engine._queues, f"queues left: {list(server.engine._queues)}"


@pytest.fixture(scope="module")
def long_server(engine_args):
    """A server whose context is long enough that a request cannot finish while its client
    disconnects: 2 x 900 tokens take seconds, noticing a dropped client milliseconds."""
    with ServerThread(dataclasses.replace(engine_args, max_model_len=1024), API_KEY) as running:
        yield running


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_disconnect_aborts_and_frees_kv(long_server, route, stream):
    server = long_server
    _assert_idle(server)
    generated_before = server.metric("ember:generation_tokens_total")
    body = dict(model=MODEL_NAME, max_tokens=900, ignore_eos=True, stream=stream, n=2)
    body.update(prompt=PROMPTS[0]) if route == "completions" else body.update(messages=CHAT)
    sock = _raw_request(server, f"/v1/{route}", body)
    if stream:
        assert b"200 OK" in sock.recv(4096)  # headers, then at least the first event
    server.wait_for_metric("ember:kv_cache_usage_perc", lambda v: v > 0.0)
    sock.close()
    _assert_idle(server)
    generated = server.metric("ember:generation_tokens_total") - generated_before
    assert generated < 2 * 900  # cut short, not run to max_tokens


# --- soak: mixed requests, some dropped by their clients; nothing leaks ---


def _engine_rss_kib(server) -> int:
    status = pathlib.Path(f"/proc/{server.engine.engine_core_pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))


async def _soak(server, num_requests: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    counts = {"ok": 0, "dropped": 0}
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(
        base_url=f"{server.base_url}/v1", headers=AUTH, timeout=120
    ) as http:

        async def one(i: int) -> None:
            chat = rng.random() < 0.5
            body = dict(
                max_tokens=rng.randint(1, 24),
                temperature=rng.choice([0.0, 0.8]),
                n=rng.choice([1, 1, 2]),
                stream=rng.random() < 0.5,
                seed=i,
            )
            if rng.random() < 0.3:
                body["stop"] = ["e", "\n"]
            if chat:
                body["messages"] = [{"role": "user", "content": PROMPTS[i % 3] * rng.randint(1, 4)}]
                route = "/chat/completions"
            else:
                body["prompt"] = PROMPTS[i % 3] * rng.randint(1, 4)
                route = "/completions"
            drop = rng.random() < 0.25
            async with gate:
                if body["stream"]:
                    async with http.stream("POST", route, json=body) as response:
                        assert response.status_code == 200
                        async for line in response.aiter_lines():
                            if drop:
                                break  # leaving the block closes the connection mid-stream
                            if line.startswith("data:") and "[DONE]" in line:
                                counts["ok"] += 1
                else:
                    request = http.post(route, json=body)
                    if drop:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(request, timeout=rng.uniform(0.01, 0.3))
                    else:
                        response = await request
                        assert response.status_code == 200, response.text
                        assert len(response.json()["choices"]) == body["n"]
                        counts["ok"] += 1
            counts["dropped"] += drop

        await asyncio.gather(*(one(i) for i in range(num_requests)))
    return counts


def _soak_and_check(server, num_requests: int) -> None:
    asyncio.run(_soak(server, 16, seed=1))  # warm-up: reach the steady-state memory
    _assert_idle(server)
    rss_before = _engine_rss_kib(server)
    counts = asyncio.run(_soak(server, num_requests, seed=2))
    assert counts["dropped"] > num_requests // 10 and counts["ok"] > num_requests // 2
    _assert_idle(server)
    growth_mib = (_engine_rss_kib(server) - rss_before) / 1024
    assert growth_mib < 64, f"engine memory grew {growth_mib:.0f} MiB over the soak"
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_soak_mixed_requests_leak_nothing(server):
    _soak_and_check(server, 40)


@pytest.mark.slow
def test_long_soak_mixed_requests_leak_nothing(server):
    _soak_and_check(server, 300)
