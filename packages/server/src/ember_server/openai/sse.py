"""Server-sent events framing of streamed OpenAI responses."""

from __future__ import annotations

import msgspec
from pydantic import BaseModel

from ember_server.openai.protocol import UsageInfo

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"

_json = msgspec.json.Encoder()


def sse_event(payload: BaseModel) -> str:
    """One ``data:`` event holding the model as compact JSON (JSON never holds a raw newline)."""
    return f"data: {payload.model_dump_json()}\n\n"


class StreamEvents:
    """The SSE events of one streamed response (a completion or chat chunk type).

    Every chunk of a stream repeats the same envelope (id, object, created, model): it is encoded
    once, here, and each chunk encodes only its choices and usage. A choice is a pydantic model,
    or, for the one-per-token chunks, a dict from ``text_choice`` / ``content_choice``, which
    msgspec encodes about ten times faster than pydantic builds and dumps the model, to the same
    JSON (``test_sse.py`` holds the two to it).
    """

    def __init__(
        self, response_type: type[BaseModel], request_id: str, created: int, model: str
    ) -> None:
        envelope = response_type(id=request_id, created=created, model=model, choices=[])
        head, choices, tail = envelope.model_dump_json().partition('"choices":[]')
        if not choices or tail != ',"usage":null}':
            raise TypeError(f"{response_type.__name__} does not end with choices and usage")
        self._head = f'data: {head}"choices":['

    def chunk(self, choices: list[BaseModel | dict], usage: UsageInfo | None = None) -> str:
        encoded = ",".join(
            choice.model_dump_json()
            if isinstance(choice, BaseModel)
            else _json.encode(choice).decode()
            for choice in choices
        )
        usage_json = "null" if usage is None else usage.model_dump_json()
        return f'{self._head}{encoded}],"usage":{usage_json}}}\n\n'


def text_choice(index: int, text: str, finish_reason: str | None, stop_reason) -> dict:
    """A ``CompletionResponseStreamChoice`` without logprobs, as a dict in its field order."""
    return {
        "index": index,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def content_choice(index: int, content: str, finish_reason: str | None, stop_reason) -> dict:
    """A ``ChatCompletionResponseStreamChoice`` whose delta is content only, without logprobs,
    as a dict in its field order."""
    return {
        "index": index,
        "delta": {"role": None, "content": content, "tool_calls": None, "reasoning_content": None},
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def parse_sse(body: str) -> list[str]:
    """The ``data`` payloads of an event stream, in order (for clients and tests)."""
    events: list[str] = []
    for block in body.split("\n\n"):
        lines = [line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events
