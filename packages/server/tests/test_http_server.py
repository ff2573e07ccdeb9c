"""The OpenAI-compatible server driven by the official ``openai`` client, checked against ``LLM``.

One server (engine core process included) serves the whole module, behind an API key: starting
one costs seconds (``http_suite``). Good requests here; bad input (each case while a good request
runs), arbitrary bodies, client disconnects and the soak are in
``test_http_server_robustness``.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest
from http_suite import API_KEY, AUTH, CHAT, MODEL_NAME, PROMPTS, client, engine_args, server

from ember_scheduler.sampling_params import SamplingParams

__all__ = ["client", "engine_args", "server"]  # fixtures, used by name


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
