"""Tool calls in chat outputs: forced calls read from grammar-constrained JSON, and calls parsed
out of free text (``tool_choice: "auto"``) by the parser ``--tool-call-parser`` names.

Each stream class turns one choice's text deltas into ``DeltaMessage`` pieces in OpenAI's shape:
the first piece of a call carries its index, id, type and name; later pieces more arguments.
"""

from __future__ import annotations

import json

from ember_server.openai.protocol_chat import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from ember_server.openai.tool_parsers import TOOL_PARSERS

TOOL_CALLS = "tool_calls"  # the finish reason of an output that is a call


def forced_tool_call(request: ChatCompletionRequest, text: str) -> ToolCall | None:
    """The call in a forced output: the named function's arguments, or (``required``) JSON
    ``{"name", "arguments"}``. The grammar guarantees the shape of a whole output; one a stop
    string cut short gives None (it stays text)."""
    name = request.forced_function
    if name is not None:
        return ToolCall(function=FunctionCall(name=name, arguments=text))
    try:
        call = json.loads(text)
    except ValueError:
        return None
    arguments = json.dumps(call["arguments"])
    return ToolCall(function=FunctionCall(name=call["name"], arguments=arguments))


def _delta_call(index: int, call: ToolCall) -> DeltaToolCall:
    return DeltaToolCall(
        index=index,
        id=call.id,
        type="function",
        function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments),
    )


class HermesToolParser:
    """Hermes-style calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks,
    as Hermes, Qwen 2.5 and Qwen 3 write them. A block that is not such JSON stays text."""

    START, END, AT_START = "<tool_call>", "</tool_call>", False

    def parse(self, text: str, tools=None) -> tuple[str | None, list[ToolCall]]:
        """``(the text outside calls, or None when there is none; the calls)``."""
        content, calls, rest = [], [], text
        while (start := rest.find(self.START)) >= 0:
            end = rest.find(self.END, start)
            if end < 0:
                break
            call = self._call(rest[start + len(self.START) : end])
            content.append(rest[:start] if call else rest[: end + len(self.END)])
            if call:
                calls.append(call)
            rest = rest[end + len(self.END) :]
        content.append(rest)
        text_outside = "".join(content)
        return (text_outside if text_outside.strip() else None) if calls else text, calls

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        return ToolCall(function=FunctionCall(name=call["name"], arguments=json.dumps(arguments)))


TOOL_CALL_PARSERS = {"hermes": HermesToolParser, **TOOL_PARSERS}


class ParsedCallStream:
    """Streams text as content until a call starts, then each call once it is complete (text
    that could still become a call's start is held back): a call's name and arguments never go
    out in pieces. A parser without ``END`` has its calls run to the end of the output; one
    with ``AT_START`` has calls only in an output that begins with one of its ``PREFIXES``."""

    def __init__(self, parser, tools=None) -> None:
        self.parser = parser
        self.tools = tools
        self._buffer = ""
        self._num_calls = 0
        self._to_the_end = False  # the rest of the output is a call (parsed at the finish)
        self._plain = False  # an AT_START parser's output that is text only

    def feed(self, text: str) -> DeltaMessage | None:
        self._buffer += text
        parser = self.parser
        if self._to_the_end:
            return None
        if parser.AT_START and not self._plain:
            head = self._buffer.lstrip()
            if not head or any(len(head) < len(p) and p.startswith(head) for p in parser.PREFIXES):
                return None
            if head.startswith(parser.PREFIXES):
                self._to_the_end = True
                return None
            self._plain = True
        if self._plain:
            content, self._buffer = self._buffer, ""
            return self._delta(content, [])
        content, calls = [], []
        while True:
            start = self._buffer.find(parser.START)
            if start < 0:
                keep = partial_suffix(self._buffer, parser.START)
                content.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            if parser.END is None:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._to_the_end = True
                break
            end = self._buffer.find(parser.END, start)
            if end < 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                break
            content.append(self._buffer[:start])
            block = self._buffer[start : end + len(parser.END)]
            self._buffer = self._buffer[end + len(parser.END) :]
            text_outside, found = parser.parse(block, self.tools)
            content.append(text_outside or "")
            calls.extend(found)
        return self._delta("".join(content), calls)

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """What is left (an unfinished block is text), and the finish reason to report."""
        content, calls = self._buffer, []
        if self._to_the_end:
            content, calls = self.parser.parse(self._buffer, self.tools)
        delta = self._delta(content or "", calls)
        self._buffer = ""
        if self._num_calls and finish_reason == "stop":
            finish_reason = TOOL_CALLS
        return delta, finish_reason

    def _delta(self, content: str, calls: list[ToolCall]) -> DeltaMessage | None:
        if not content and not calls:
            return None
        deltas = [_delta_call(self._num_calls + i, call) for i, call in enumerate(calls)]
        self._num_calls += len(calls)
        return DeltaMessage(content=content or None, tool_calls=deltas or None)


class NamedCallStream:
    """A forced call of a named function: its id and name first, then the arguments as they
    are generated."""

    def __init__(self, name: str) -> None:
        self._head: ToolCall | None = ToolCall(function=FunctionCall(name=name, arguments=""))

    def feed(self, text: str) -> DeltaMessage | None:
        if self._head is not None:
            head, self._head = self._head, None
            head.function.arguments = text
            return DeltaMessage(tool_calls=[_delta_call(0, head)])
        if not text:
            return None
        arguments = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))
        return DeltaMessage(tool_calls=[arguments])

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        delta = self.feed("") if self._head is not None else None
        return delta, TOOL_CALLS if finish_reason == "stop" else finish_reason


class RequiredCallStream:
    """A forced call of any of the tools: the name is known only once the JSON is complete, so
    the call goes out in one piece at the end."""

    def __init__(self, request: ChatCompletionRequest) -> None:
        self.request = request
        self._text = ""

    def feed(self, text: str) -> DeltaMessage | None:
        self._text += text
        return None

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        call = forced_tool_call(self.request, self._text) if finish_reason == "stop" else None
        if call is None:
            return DeltaMessage(content=self._text or None), finish_reason
        return DeltaMessage(tool_calls=[_delta_call(0, call)]), TOOL_CALLS


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
