"""Request models: OpenAI field names, strict types, and the mapping to SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ember_server.openai.protocol_chat import ChatCompletionRequest
from ember_server.openai.protocol_completion import CompletionRequest
from ember_server.openai.protocol_tokenize import TokenizeChatRequest, TokenizeCompletionRequest
from ember_server.openai.sse import DONE, parse_sse, sse_event


def _errors(model, body) -> list[tuple]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return [(e["type"], e["loc"]) for e in info.value.errors()]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hi", ["hi"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    assert CompletionRequest(prompt=prompt).prompts() == expected


def test_completion_maps_every_sampling_field():
    req = CompletionRequest.model_validate(
        dict(
            prompt="x",
            n=2,
            temperature=0.5,
            top_p=0.9,
            top_k=7,
            min_p=0.1,
            presence_penalty=0.3,
            frequency_penalty=-0.2,
            repetition_penalty=1.1,
            seed=3,
            stop="\n",
            stop_token_ids=[5],
            ignore_eos=True,
            min_tokens=2,
            logprobs=3,
            skip_special_tokens=False,
            include_stop_str_in_output=True,
        )
    )
    sp = req.to_sampling_params(max_tokens=9)
    assert (sp.n, sp.max_tokens, sp.min_tokens, sp.temperature) == (2, 9, 2, 0.5)
    assert (sp.top_p, sp.top_k, sp.min_p, sp.seed) == (0.9, 7, 0.1, 3)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.3, -0.2, 1.1)
    assert (sp.stop, sp.stop_token_ids, sp.ignore_eos, sp.logprobs) == (["\n"], [5], True, 3)
    assert not sp.skip_special_tokens and sp.include_stop_str_in_output


def test_defaults_follow_openai():
    sp = CompletionRequest(prompt="x").to_sampling_params(max_tokens=16)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.n, sp.logprobs) == (1.0, 1.0, 0, 1, None)
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).max_tokens is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -1.0), ("top_p", 0.0), ("n", 0), ("presence_penalty", 3.0), ("min_p", 2.0)],
)
def test_out_of_range_sampling_values_name_the_field(field, value):
    req = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(ValueError, match=field):
        req.to_sampling_params(max_tokens=4)


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"prompt": "x", "max_tokens": "10"}, ("max_tokens",)),
        ({"prompt": "x", "max_tokens": 2.5}, ("max_tokens",)),
        ({"prompt": "x", "temperature": "hot"}, ("temperature",)),
        ({"prompt": "x", "stream": "yes"}, ("stream",)),
        ({"prompt": "x", "n": True}, ("n",)),
        ({}, ("prompt",)),
    ],
)
def test_wrong_types_and_missing_fields_are_rejected(body, loc):
    assert any(found[: len(loc)] == loc for _, found in _errors(CompletionRequest, body))


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", 2**63), ("seed", -(2**63) - 1), ("top_k", 2**64), ("priority", 2**70), ("n", 129)],
)
def test_integers_beyond_what_the_engine_takes_are_rejected(field, value):
    assert any(
        loc[0] == field for _, loc in _errors(CompletionRequest, {"prompt": "x", field: value})
    )


def test_prompt_of_wrong_shape_is_rejected():
    assert _errors(CompletionRequest, {"prompt": 3})
    assert _errors(CompletionRequest, {"prompt": []})
    assert _errors(CompletionRequest, {"prompt": [1, "a"]})


@pytest.mark.parametrize(
    "extra",
    [
        {"stream_options": {"include_usage": True}},  # without stream
        {"best_of": 3},
        {"logit_bias": {"5": 1.0}},
        {"suffix": "!"},
        {"echo": True, "logprobs": 1, "stream": True},
        {"prompt_logprobs": 1, "stream": True},
        {"max_tokens": 0},
    ],
)
def test_unsupported_or_inconsistent_completion_fields(extra):
    assert _errors(CompletionRequest, {"prompt": "x", **extra})


@pytest.mark.parametrize(("field", "value"), [("logprobs", 21), ("min_tokens", 2**40)])
def test_sampling_ranges_are_checked_once_by_sampling_params(field, value):
    request = CompletionRequest.model_validate({"prompt": "x", field: value})
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be in"):
        request.to_sampling_params(max_tokens=None)


def test_unknown_fields_are_ignored_and_listed():
    req = CompletionRequest.model_validate({"prompt": "x", "frobnicate": 1, "zeta": True})
    assert req.ignored_fields == ["frobnicate", "zeta"]


def test_stream_options_include_usage():
    req = CompletionRequest.model_validate(
        {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    )
    assert req.include_usage
    assert not CompletionRequest(prompt="x", stream=True).include_usage


def test_chat_logprobs_and_max_tokens():
    msgs = [{"role": "user", "content": "x"}]
    req = ChatCompletionRequest.model_validate(
        {"messages": msgs, "logprobs": True, "top_logprobs": 4}
    )
    assert req.to_sampling_params(max_tokens=5).logprobs == 4
    req = ChatCompletionRequest.model_validate({"messages": msgs, "logprobs": True})
    assert req.to_sampling_params(max_tokens=5).logprobs == 0
    assert (
        ChatCompletionRequest.model_validate({"messages": msgs})
        .to_sampling_params(max_tokens=5)
        .logprobs
        is None
    )
    req = ChatCompletionRequest.model_validate(
        {"messages": msgs, "max_tokens": 3, "max_completion_tokens": 7}
    )
    assert req.requested_max_tokens == 7
    assert _errors(ChatCompletionRequest, {"messages": msgs, "top_logprobs": 2})
    assert _errors(ChatCompletionRequest, {"messages": msgs, "logprobs": True, "top_logprobs": 99})
    assert _errors(ChatCompletionRequest, {"messages": msgs, "tools": [{"type": "function"}]})
    assert _errors(ChatCompletionRequest, {"messages": []})
    assert _errors(ChatCompletionRequest, {"messages": [{"content": "no role"}]})


def test_chat_content_parts_are_joined():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        }
    )
    assert req.conversation() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    image = {"type": "image_url", "image_url": {"url": "http://x"}}
    assert _errors(ChatCompletionRequest, {"messages": [{"role": "user", "content": [image]}]})


def test_tokenize_request_forms():
    assert TokenizeCompletionRequest.model_validate({"prompt": "x"}).add_special_tokens
    chat = TokenizeChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat.add_generation_prompt


def test_sse_framing_round_trips():
    req = CompletionRequest(prompt="line one\nline two")
    body = sse_event(req) + sse_event(req) + DONE
    assert body.count("\n\n") == 3
    events = parse_sse(body)
    assert events[-1] == "[DONE]"
    assert [CompletionRequest.model_validate_json(e) for e in events[:2]] == [req, req]
