"""Server-sent events framing of streamed OpenAI responses."""

from __future__ import annotations

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def sse_event(payload: BaseModel) -> str:
    """One ``data:`` event holding the model as compact JSON (JSON never holds a raw newline)."""
    return f"data: {payload.model_dump_json()}\n\n"


def parse_sse(body: str) -> list[str]:
    """The ``data`` payloads of an event stream, in order (for clients and tests)."""
    events: list[str] = []
    for block in body.split("\n\n"):
        lines = [line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events
