"""``--reasoning-parser`` over HTTP, on a tokenizer with think tokens (``<think>``, ``</think>``
added as ordinary tokens, as Qwen3 and DeepSeek-R1 have them), and ``chat_template_kwargs``."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from server_thread import ServerThread
from transformers import AutoTokenizer

from ember_server.engine.engine_args import EngineArgs

MODEL = "thinker"
# Qwen3's way: enable_thinking false writes an empty think block into the prompt.
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
MESSAGES = [{"role": "user", "content": "Think, then answer."}]
# The model is made to think, then answer, by a grammar (its weights are random).
GRAMMAR = 'root ::= "<think>" [a-z ]{4,24} "</think>" [a-z ]{4,24}'
BODY = {"max_tokens": 120, "temperature": 0.0}
EXTRA = {"structured_outputs": {"grammar": GRAMMAR}}


@pytest.fixture(scope="module")
def think_tokenizer(test_tokenizer_path, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(test_tokenizer_path)
    assert tokenizer.add_tokens(["<think>", "</think>"]) == 2  # not special: they stay in text
    tokenizer.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("think-tokenizer")
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def server(tiny_model, think_tokenizer):
    vocab = len(AutoTokenizer.from_pretrained(think_tokenizer))
    args = EngineArgs(
        model=str(tiny_model("llama", vocab_size=vocab)),
        tokenizer=str(think_tokenizer),
        max_model_len=512,
        kv_cache_memory=8 * 1024**2,
        served_model_name=MODEL,
        dtype="float32",
    )
    with ServerThread(args, reasoning_parser="qwen3") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_reasoning_content_is_split_off_whole_and_streamed(client, server):
    raw = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "Think.", **BODY, **EXTRA},
        timeout=60,
    ).json()["choices"][0]["text"]
    assert raw.startswith("<think>") and "</think>" in raw
    whole = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body=EXTRA, **BODY
    ).choices[0]
    thought, answer = whole.message.reasoning_content, whole.message.content
    assert thought and answer and "<think>" not in thought + answer and "</think>" not in answer
    assert whole.finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body=EXTRA, stream=True, **BODY
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    streamed_answer = "".join(d.content or "" for d in deltas)
    assert (streamed_thought, streamed_answer) == (thought, answer)
    # Each delta is one or the other, never both: the split follows the stream.
    assert not any(d.content and getattr(d, "reasoning_content", None) for d in deltas)


def test_the_same_output_without_the_tags_reaches_the_raw_text(client, server):
    """Completions keep the raw text: the chat split is exactly its tags' parts."""
    prompt = httpx.post(
        f"{server.base_url}/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=60
    ).json()["tokens"]
    raw = (
        client.completions.create(model=MODEL, prompt=prompt, extra_body=EXTRA, **BODY)
        .choices[0]
        .text
    )
    whole = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=EXTRA, **BODY)
        .choices[0]
        .message
    )
    assert raw == f"<think>{whole.reasoning_content}</think>{whole.content}"


def test_chat_template_kwargs_reach_the_template(server, think_tokenizer):
    tokenizer = AutoTokenizer.from_pretrained(think_tokenizer)
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])

    def tokens(**extra):
        body = {"model": MODEL, "messages": MESSAGES, **extra}
        return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()["tokens"]

    plain = tokens()
    off = tokens(chat_template_kwargs={"enable_thinking": False})
    assert think not in plain and off[: len(plain)] == plain
    assert think in off[len(plain) :] and end in off[len(plain) :]
    # With thinking off, the answer after the prompt's empty block is all content.
    reply = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": MESSAGES,
            "chat_template_kwargs": {"enable_thinking": False},
            "structured_outputs": {"grammar": "root ::= [a-z ]{4,24}"},
            **BODY,
        },
        timeout=60,
    ).json()
    message = reply["choices"][0]["message"]
    assert reply["usage"]["prompt_tokens"] == len(off)
    assert message["reasoning_content"] is None and message["content"]


def test_anthropic_messages_answer_thinking_blocks(client, server):
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    kwargs = dict(
        model=MODEL, messages=MESSAGES, max_tokens=120, extra_body={**EXTRA, "temperature": 0.0}
    )
    whole = messages.messages.create(**kwargs)
    expected = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=EXTRA, **BODY)
        .choices[0]
        .message
    )
    thinking, text = whole.content
    assert (thinking.type, thinking.thinking) == ("thinking", expected.reasoning_content)
    assert (text.type, text.text) == ("text", expected.content)
    with messages.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == thinking.thinking and final.content[1].text == text.text
    assert json.loads(whole.model_dump_json())["stop_reason"] == "end_turn"


def test_responses_answer_a_reasoning_item_then_the_message(client):
    expected = (
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=EXTRA, **BODY)
        .choices[0]
        .message
    )
    kwargs = dict(model=MODEL, input=MESSAGES[0]["content"], max_output_tokens=120, temperature=0.0)
    for stream in (False, True):
        if stream:
            events = list(client.responses.create(stream=True, extra_body=EXTRA, **kwargs))
            response = events[-1].response
            deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
            assert "".join(deltas) == expected.reasoning_content
        else:
            response = client.responses.create(extra_body=EXTRA, **kwargs)
        reasoning, message = response.output
        assert reasoning.type == "reasoning"
        assert reasoning.content[0].text == expected.reasoning_content
        assert message.type == "message" and response.output_text == expected.content
