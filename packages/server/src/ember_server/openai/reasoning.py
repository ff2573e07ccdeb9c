"""Reasoning parsers: a model's thinking, written inside ``<think>...</think>``, told apart from
its answer (``--reasoning-parser``).

- ``deepseek_r1``: DeepSeek-R1's chat template opens the think block in the prompt, so the output
  is reasoning from its start (an opening ``<think>`` it writes anyway is dropped) until
  ``</think>``; an output that never closes the block is reasoning only.
- ``qwen3``: Qwen3 opens the block itself, so only an output that begins with ``<think>`` holds
  reasoning (a template run with ``enable_thinking: false`` writes an empty block into the
  prompt, and the output is all answer).

Whole outputs and streams go through the same state machine (``ReasoningStream``), so a streamed
choice splits exactly as the whole one, wherever its chunks break a tag.
"""

from __future__ import annotations

from ember_server.openai.tool_calls import partial_suffix


class ReasoningStream:
    """Splits one choice's text deltas into (reasoning, content) deltas; text that could still
    become a tag is held back until the next delta (or ``finish``)."""

    START, END = "<think>", "</think>"

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self._state = "open"  # before the output's start is known; then reasoning, content
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = "", ""
        while self._buffer:
            if self._state == "open":
                if len(self._buffer) < len(self.START) and self.START.startswith(self._buffer):
                    # "<thi": not known yet
                    break
                if self._buffer.startswith(self.START):
                    self._buffer = self._buffer[len(self.START) :]
                    self._state = "reasoning"
                else:
                    self._state = "reasoning" if self.starts_in_reasoning else "content"
            elif self._state == "reasoning":
                end = self._buffer.find(self.END)
                if end >= 0:
                    reasoning += self._buffer[:end]
                    self._buffer = self._buffer[end + len(self.END) :]
                    self._state = "content"
                    continue
                keep = len(self._buffer) - partial_suffix(self._buffer, self.END)
                reasoning += self._buffer[:keep]
                self._buffer = self._buffer[keep:]
                break
            else:
                content += self._buffer
                self._buffer = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back, as reasoning or content (the output ended)."""
        rest, self._buffer = self._buffer, ""
        if self._state == "open":
            self._state = "reasoning" if self.starts_in_reasoning else "content"
        return (rest, "") if self._state == "reasoning" else ("", rest)


class ThinkReasoningParser:
    """A ``<think>...</think>`` family; ``starts_in_reasoning`` when the prompt opens the block."""

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.starts_in_reasoning = starts_in_reasoning

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_in_reasoning)

    def split(self, text: str) -> tuple[str | None, str]:
        """``(the reasoning, or None when there is none; the content)`` of a whole output."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning += more_reasoning
        content += more_content
        return reasoning or None, content


REASONING_PARSERS = {
    "deepseek_r1": lambda: ThinkReasoningParser(starts_in_reasoning=True),
    "qwen3": lambda: ThinkReasoningParser(starts_in_reasoning=False),
}


def reasoning_parser(name: str | None) -> ThinkReasoningParser | None:
    """The parser ``name`` (a key of ``REASONING_PARSERS``), or None; ValueError naming the
    setting for an unknown name."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}"
        )
    return REASONING_PARSERS[name]()
