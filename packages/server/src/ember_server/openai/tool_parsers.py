"""Tool-call parsers beside Hermes' (``tool_calls.HermesToolParser``), by the format a model family
writes its calls in. Each has ``parse(text, tools)`` -> ``(the text outside calls or None, the
calls)`` and the framing ``ParsedCallStream`` needs to stream it: ``START`` (where a call
begins), ``END`` (where it ends; None: at the end of the output) and ``AT_START`` (a call only
when the output begins with one of its ``PREFIXES``). A call that does not parse stays text.

- ``llama3_json`` (Llama 3.1-3.3): the output is ``{"name": ..., "parameters": {...}}`` objects
  separated by ``;``, optionally after ``<|python_tag|>``.
- ``mistral``: text, then ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``.
- ``qwen3_xml`` (Qwen3-Coder): ``<tool_call><function=NAME><parameter=P>value</parameter>...
  </function></tool_call>`` blocks; values are typed by the tool's JSON schema (a ``string``
  parameter stays text, others are read as JSON where they parse).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ember_server.openai.protocol_chat import ChatTool, FunctionCall, ToolCall

_DECODER = json.JSONDecoder()


def _call(name: Any, arguments: Any) -> ToolCall | None:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(function=FunctionCall(name=name, arguments=json.dumps(arguments)))


class Llama3JsonToolParser:
    """Llama 3's JSON calls: the whole output, one or more objects separated by ``;``."""

    START, END, AT_START = "{", None, True
    PYTHON_TAG = "<|python_tag|>"
    PREFIXES = (START, PYTHON_TAG)  # how an output that is a call begins

    def parse(self, text: str, tools: list[ChatTool] | None = None):
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        calls, position = [], 0
        while position < len(body):
            try:
                value, end = _DECODER.raw_decode(body, position)
            except ValueError:
                return text, []
            if not isinstance(value, dict):
                return text, []
            call = _call(value.get("name"), value.get("parameters", value.get("arguments", {})))
            if call is None:
                return text, []
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\n;":
                position += 1
        return (None, calls) if calls else (text, [])


class MistralToolParser:
    """Mistral's calls: ``[TOOL_CALLS]`` then a JSON array, to the end of the output."""

    START, END, AT_START = "[TOOL_CALLS]", None, False

    def parse(self, text: str, tools: list[ChatTool] | None = None):
        start = text.find(self.START)
        if start < 0:
            return text, []
        rest = text[start + len(self.START) :].lstrip()
        try:
            value, end = _DECODER.raw_decode(rest)
        except ValueError:
            return text, []
        if rest[end:].strip():
            return text, []
        entries = value if isinstance(value, list) else [value]
        calls = [
            _call(e.get("name"), e.get("arguments", {})) if isinstance(e, dict) else None
            for e in entries
        ]
        if not calls or None in calls:
            return text, []
        content = text[:start]
        return (content if content.strip() else None), calls


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3XMLToolParser:
    """Qwen3-Coder's XML calls inside ``<tool_call>`` blocks; values typed by the schema."""

    START, END, AT_START = "<tool_call>", "</tool_call>", False

    def parse(self, text: str, tools: list[ChatTool] | None = None):
        content, calls, rest = [], [], text
        while (start := rest.find(self.START)) >= 0:
            end = rest.find(self.END, start)
            if end < 0:
                break
            call = self._block(rest[start + len(self.START) : end], tools or [])
            content.append(rest[:start] if call else rest[: end + len(self.END)])
            if call is not None:
                calls.append(call)
            rest = rest[end + len(self.END) :]
        content.append(rest)
        outside = "".join(content)
        return (outside if outside.strip() else None) if calls else text, calls

    @staticmethod
    def _block(body: str, tools: list[ChatTool]) -> ToolCall | None:
        match = _FUNCTION.search(body)
        if match is None or body[: match.start()].strip() or body[match.end() :].strip():
            return None
        name = match.group(1).strip()
        schema = next((t.function.parameters for t in tools if t.function.name == name), None)
        properties = (schema or {}).get("properties", {})
        arguments = {}
        for parameter in _PARAMETER.finditer(match.group(2)):
            key = parameter.group(1).strip()
            arguments[key] = _typed(parameter.group(2), properties.get(key))
        return _call(name, arguments)


def _typed(raw: str, schema: Any) -> Any:
    """A parameter's text (one newline each side dropped) as its schema's type."""
    value = raw.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string"):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


TOOL_PARSERS = {
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_xml": Qwen3XMLToolParser,
}
