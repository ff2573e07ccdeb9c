"""The OpenAI-compatible server driven by the official ``openai`` client, checked against ``LLM``.

One server (engine core process included) serves the whole module, behind an API key: starting
one costs seconds. Sections: good requests, bad input (each case while a good request runs),
client disconnects, and a bounded soak of mixed requests.
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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_thread import ServerThread

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.engine_args import EngineArgs
from ember_server.openai.sse import parse_sse

MODEL_NAME = "tiny-llama"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["def main(argv):\n    ", "The quick brown fox", "import json\n"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(
    scope="module",
    params=[
        ("llama", 1),
        pytest.param(("llama", 2), marks=pytest.mark.slow),
        pytest.param(("gemma3_text", 1), marks=pytest.mark.slow),
    ],
    ids=["dp1", "dp2", "gemma3"],
)
def engine_args(tiny_model, request) -> EngineArgs:
    """The suite runs against one engine core, and (slow) against two behind one server, and
    against a model with sliding-window and global layers (one KV block table each)."""
    arch, data_parallel_size = request.param
    return EngineArgs(
        model=str(tiny_model(arch)),
        dtype="float32",
        max_model_len=128,
        max_num_seqs=16,
        kv_cache_memory=2 * 1024**2,
        served_model_name=MODEL_NAME,
        data_parallel_size=data_parallel_size,
    )


@pytest.fixture(scope="module")
def server(engine_args):
    with ServerThread(engine_args, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(engine_args):
    from ember_server.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(dataclasses.replace(engine_args, data_parallel_size=1)))
    yield llm
    llm.shutdown()


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _counts(usage) -> tuple[int, int, int]:
    """Token counts of a usage; the prefix-cache hits differ between repeats of one prompt."""
    return usage.prompt_tokens, usage.completion_tokens, usage.total_tokens


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == 128
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_greedy_completions_match_offline(client, offline):
    expected = offline.generate(PROMPTS, _greedy(), use_tqdm=False)
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0.0
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert [c.text for c in result.choices] == [e.outputs[0].text for e in expected]
    assert [c.finish_reason for c in result.choices] == [
        e.outputs[0].finish_reason for e in expected
    ]
    assert result.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    completion_tokens = sum(len(e.outputs[0].token_ids) for e in expected)
    assert result.usage.completion_tokens == completion_tokens
    assert result.usage.total_tokens == result.usage.prompt_tokens + completion_tokens


def test_greedy_chat_matches_offline(client, offline):
    expected = offline.chat(CHAT, _greedy(10), use_tqdm=False)[0]
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=10, temperature=0.0
    )
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_streamed_completion_equals_whole_one(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0.0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and _counts(chunks[-1].usage) == _counts(whole.usage)
    assert len(text_chunks) > 1


def test_streamed_multi_prompt_logprobs_and_continuous_usage(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[:2], max_tokens=5, n=2, seed=3, logprobs=2)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
        assert chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert sorted(texts) == [0, 1, 2, 3]  # prompt p, choice i -> index 2 * p + i
    for choice in whole.choices:
        assert texts[choice.index] == choice.text
        assert tokens[choice.index] == choice.logprobs.tokens
    assert _counts(chunks[-1].usage) == _counts(whole.usage)


def test_streamed_chat_equals_whole_one(client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0.0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert _counts(chunks[-1].usage) == _counts(whole.usage)
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain)


def test_repeated_prompt_reports_its_cached_blocks(client, engine_args):
    """A prompt sharing a prefix with an earlier one reports at least the prefix's whole blocks
    as cached, in completions and chat, whole and streamed (the last chunk's usage)."""
    block = engine_args.block_size
    prefix = "def main(argv):\n    return 0\n" * 4
    first = client.completions.create(model=MODEL_NAME, prompt=prefix, max_tokens=1)
    shared_blocks = first.usage.prompt_tokens // block * block
    assert shared_blocks >= block
    kwargs = dict(model=MODEL_NAME, prompt=prefix + "print(1)", max_tokens=2)
    whole = client.completions.create(**kwargs)
    assert whole.usage.prompt_tokens_details.cached_tokens >= shared_blocks
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= shared_blocks
    messages = [{"role": "user", "content": prefix}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    # A whole-prompt hit still computes the last token, so its block may be recomputed.
    chat_blocks = (chat.usage.prompt_tokens - 1) // block * block
    again = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= chat_blocks > 0
    streamed = list(
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= chat_blocks


def test_n_2_with_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=5, n=2)
    result = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.usage.completion_tokens == 16
    assert result.choices[0].text != result.choices[1].text
    again = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in result.choices]
    streamed = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=6, n=2, seed=5, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, n=2, seed=5
    )
    assert texts == {c.index: c.message.content for c in whole.choices}


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_n_2_with_the_extreme_seeds_is_served(client, seed):
    # Child seeds wrap within int64: a valid seed is never refused for its children's sake.
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, n=3, seed=seed
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2]


def test_seed_reproducibility(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


def test_completion_logprobs(client):
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0.0, logprobs=3
    )
    choice = result.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert result.usage.completion_tokens == 6 or choice.finish_reason == "stop"
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0.0
        assert 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the best
        assert top[token] == pytest.approx(value, abs=1e-5)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(client):
    result = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=5,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[1].logprob <= entry.logprob
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    no_lp = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2)
    assert no_lp.choices[0].logprobs is None


def test_stop_strings(client):
    base = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0.0)
    full = client.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop and full.index(stop) > 0
    cut = client.completions.create(**base, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    kept = client.completions.create(
        **base, stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]
    streamed = client.completions.create(
        **base, stop=[stop], stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_usage_accounting(server, client):
    prompt = PROMPTS[1]
    count = httpx.post(f"{server.base_url}/tokenize", json={"prompt": prompt}, headers=AUTH).json()[
        "count"
    ]
    result = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=7, extra_body={"ignore_eos": True}
    )
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (count, 7)
    assert result.choices[0].finish_reason == "length"
    token_prompt = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=3)
    assert token_prompt.usage.prompt_tokens == 4


def test_default_max_tokens(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], extra_body={"ignore_eos": True}
    )
    assert completion.usage.completion_tokens == 16  # OpenAI's default for completions
    long_chat = [{"role": "user", "content": "the quick brown fox " * 11}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=long_chat, extra_body={"ignore_eos": True}
    )
    assert chat.usage.prompt_tokens > 60
    assert chat.usage.total_tokens == 128  # chat: up to the context length


def test_echo(client):
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0.0, echo=True
    )
    plain = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0.0
    )
    assert result.choices[0].text == PROMPTS[2] + plain.choices[0].text


def test_tokenize_detokenize(server):
    url = server.base_url
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "hello world"}, headers=AUTH).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens["tokens"]}, headers=AUTH)
    assert text.json()["prompt"].endswith("hello world")
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}, headers=AUTH).json()
    assert chat["count"] > tokens["count"]


def test_metrics_use_vllm_names(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3)
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in (
        "ember:time_to_first_token_seconds_bucket",
        "ember:inter_token_latency_seconds_bucket",
        "ember:e2e_request_latency_seconds_bucket",
        "ember:num_requests_running",
        "ember:num_requests_waiting",
        "ember:kv_cache_usage_perc",
        "ember:prefix_cache_queries_total",
        "ember:prefix_cache_hits_total",
        "ember:num_preemptions_total",
        "ember:prompt_tokens_total",
        "ember:generation_tokens_total",
    ):
        assert name in text, name
    assert server.metric("ember:generation_tokens_total") >= 3


def test_api_key(server):
    url = f"{server.base_url}/v1/models"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url, headers=AUTH).status_code == 200
    for open_path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{server.base_url}{open_path}").status_code == 200
    assert httpx.options(url).status_code != 401  # a CORS preflight carries no credentials
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1)


def test_bench_serve_against_the_server(server, tmp_path, capsys):
    from ember_server.cli.main import main

    out_json = tmp_path / "serve.json"
    argv = ["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY]
    argv += ["--concurrency", "1", "3", "--num-prompts", "3", "--input-len", "4"]
    assert main([*argv, "--output-len", "3", "--output-json", str(out_json)]) == 0
    results = json.loads(out_json.read_text())
    assert results["model"] == MODEL_NAME
    assert [level["concurrency"] for level in results["levels"]] == [1, 3]
    for level in results["levels"]:
        assert (level["completed"], level["failed"], level["output_tokens"]) == (3, 0, 9)
        assert level["ttft"]["p50_ms"] > 0 and "p99_ms" in level["itl"]
    assert "TTFT p50" in capsys.readouterr().out


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
