"""The SSE chunks of streamed responses: the fast encoding is the pydantic models' JSON, exactly."""

from __future__ import annotations

import pytest

from ember_server.openai.protocol import UsageInfo
from ember_server.openai.protocol_chat import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    DeltaMessage,
)
from ember_server.openai.protocol_completion import (
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from ember_server.openai.sse import StreamEvents, content_choice, sse_event, text_choice

TEXTS = [
    "",
    "plain words",
    'quotes " and \\ backslashes',
    "new\nline\ttab\rreturn\x00nul\x1fus\x7fdel",
    "Grüße 日本語 🙂 \u2028\u2029 \ufeff",
    "</script><!-- & ' -->",
]
ENDINGS = [(None, None), ("length", None), ("stop", "###"), ("stop", 7)]
USAGES = [None, UsageInfo.of(5, 3)]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish_reason", "stop_reason"), ENDINGS)
@pytest.mark.parametrize("usage", USAGES)
def test_completion_chunks_are_the_models_json(text, finish_reason, stop_reason, usage):
    events = StreamEvents(CompletionStreamResponse, "cmpl-1", 1700000000, "the-model")
    choice = CompletionResponseStreamChoice(
        index=2, text=text, finish_reason=finish_reason, stop_reason=stop_reason
    )
    expected = sse_event(
        CompletionStreamResponse(
            id="cmpl-1", created=1700000000, model="the-model", choices=[choice], usage=usage
        )
    )
    assert events.chunk([text_choice(2, text, finish_reason, stop_reason)], usage) == expected
    assert events.chunk([choice], usage) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize(("finish_reason", "stop_reason"), ENDINGS)
@pytest.mark.parametrize("usage", USAGES)
def test_chat_chunks_are_the_models_json(text, finish_reason, stop_reason, usage):
    model_name = 'a "quoted" model ✓'
    events = StreamEvents(ChatCompletionStreamResponse, "chatcmpl-1", 3, model_name)
    choice = ChatCompletionResponseStreamChoice(
        index=0,
        delta=DeltaMessage(content=text),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )
    expected = sse_event(
        ChatCompletionStreamResponse(
            id="chatcmpl-1", created=3, model=model_name, choices=[choice], usage=usage
        )
    )
    assert events.chunk([content_choice(0, text, finish_reason, stop_reason)], usage) == expected
    assert events.chunk([choice], usage) == expected


def test_a_chunk_without_choices_carries_the_usage():
    events = StreamEvents(CompletionStreamResponse, "cmpl-2", 9, "m")
    usage = UsageInfo.of(4, 6)
    expected = sse_event(
        CompletionStreamResponse(id="cmpl-2", created=9, model="m", choices=[], usage=usage)
    )
    assert events.chunk([], usage) == expected
