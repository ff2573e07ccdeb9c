"""What evaluation and training clients ask of ``/v1/completions``: ``echo`` with ``logprobs``
(``max_tokens`` 0 or 1, as lm-evaluation-harness scores), vLLM's ``prompt_logprobs``, and
``return_tokens_as_token_ids``; the echoed prompt logprobs equal the engine's own."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
from server_thread import ServerThread

from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.engine_args import EngineArgs

MODEL = "tiny-llama"
PROMPT = "The quick brown fox jumps over"


@pytest.fixture(scope="module")
def engine_args(tiny_model) -> EngineArgs:
    return EngineArgs(
        model=str(tiny_model("llama")),
        max_model_len=256,
        kv_cache_memory=4 * 1024**2,
        served_model_name=MODEL,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def server(engine_args):
    with ServerThread(engine_args) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def expected(engine_args):
    """The engine's own prompt logprobs (top 2) and greedy token of ``PROMPT``, offline."""
    from ember_server.engine.llm import LLM

    llm = LLM(**dataclasses.asdict(engine_args))
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, prompt_logprobs=2)
    (output,) = llm.generate([PROMPT], params, use_tqdm=False)
    llm.shutdown()
    return output


def _chosen(expected) -> list[float | None]:
    ids = expected.prompt_token_ids
    return [None] + [step[t].logprob for t, step in zip(ids[1:], expected.prompt_logprobs[1:])]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_returns_the_engines_prompt_logprobs(client, expected, max_tokens):
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=max_tokens, temperature=0.0
    )
    (choice,) = result.choices
    ids = expected.prompt_token_ids
    logprobs = choice.logprobs
    generated = expected.outputs[0]
    assert len(logprobs.tokens) == len(ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    chosen = _chosen(expected)
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(chosen[1:], abs=1e-5)
    for top, step in zip(logprobs.top_logprobs[1 : len(ids)], expected.prompt_logprobs[1:]):
        assert len(top) >= 2 and max(top.values()) == pytest.approx(
            max(lp.logprob for lp in step.values()), abs=1e-5
        )
    assert "".join(logprobs.tokens[: len(ids)]) == "<|bos|>" + PROMPT  # BOS is a prompt token
    assert logprobs.text_offset == [
        len("".join(logprobs.tokens[:i])) for i in range(len(ids) + max_tokens)
    ]
    if max_tokens == 0:
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert result.usage.completion_tokens == 0
    else:
        assert choice.text == PROMPT + generated.text
        token_id = generated.token_ids[0]
        assert logprobs.token_logprobs[-1] == pytest.approx(
            generated.logprobs[0][token_id].logprob, abs=1e-5
        )


def test_vllm_prompt_logprobs_extra_parameter(client, expected):
    result = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=0,
        extra_body={"prompt_logprobs": 2},
    )
    (choice,) = result.choices
    assert choice.text == "" and choice.logprobs is None
    prompt_logprobs = choice.prompt_logprobs
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(expected.prompt_token_ids)
    for entry, step in zip(prompt_logprobs[1:], expected.prompt_logprobs[1:]):
        assert {int(t) for t in entry} == set(step)
        for token_id, lp in step.items():
            assert entry[str(token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-5)
            assert entry[str(token_id)]["rank"] == lp.rank


def test_return_tokens_as_token_ids(client, expected):
    ids = expected.prompt_token_ids
    completion = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        echo=True,
        logprobs=1,
        max_tokens=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    tokens = completion.choices[0].logprobs.tokens
    assert tokens[: len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(
        t.startswith("token_id:")
        for top in completion.choices[0].logprobs.top_logprobs[1:]
        for t in top
    )
    streamed = list(
        client.completions.create(
            model=MODEL,
            prompt=ids,
            logprobs=0,
            max_tokens=3,
            temperature=0.0,
            stream=True,
            extra_body={"return_tokens_as_token_ids": True},
        )
    )
    streamed_tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        logprobs=True,
        top_logprobs=2,
        max_tokens=3,
        temperature=0.0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    for tokens in (streamed_tokens, [c.token for c in content]):
        assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens)
        assert all(int(t.split(":")[1]) >= 0 for t in tokens)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
    ],
)
def test_refused_combinations_name_their_field(server, body, field):
    response = httpx.post(
        f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}
    )
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
