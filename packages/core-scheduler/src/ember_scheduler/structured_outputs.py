"""Structured-output requests as the scheduler sees them: the spec, and who compiles it.

The scheduler never compiles a grammar or touches a token mask: a request with
``SamplingParams.structured_outputs`` waits in ``RequestStatus.WAITING_FOR_FSM`` until the
``GrammarCompiler`` it was given (implemented by the worker, with xgrammar) says the grammar is
ready, and other requests keep running meanwhile.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any, Protocol

import msgspec

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """What the output must match: exactly one of ``json`` (a JSON schema, as a dict or a JSON
    string), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these strings) or
    ``grammar`` (EBNF, as xgrammar and GBNF read it).

    ``disable_any_whitespace`` makes JSON compact (no whitespace between tokens of the JSON
    syntax); otherwise runs of whitespace are allowed but bounded, so a model cannot wander in
    whitespace forever. Shape errors raise ValueError naming the field; whether a schema, regex or
    grammar compiles is checked by the worker's grammar compiler (``check_structured_outputs``).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "SamplingParams.structured_outputs needs exactly one of "
                f"{', '.join(_KINDS)}; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json" and isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(
                    f"SamplingParams.structured_outputs.json is not valid JSON: {exc}"
                ) from None
            if not isinstance(parsed, dict):
                raise ValueError(
                    "SamplingParams.structured_outputs.json must be a JSON schema object"
                )
        if kind == "json_object" and value is not True:
            raise ValueError("SamplingParams.structured_outputs.json_object must be true")
        if kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"SamplingParams.structured_outputs.{kind} must be a non-empty string")
        if kind == "choice" and (
            not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value)
        ):
            raise ValueError(
                "SamplingParams.structured_outputs.choice must be a non-empty list of strings"
            )

    @property
    def kind(self) -> str:
        """Which of ``json``, ``json_object``, ``regex``, ``choice``, ``grammar`` is set."""
        return next(kind for kind in _KINDS if getattr(self, kind) not in (None, False))

    def cache_key(self) -> bytes:
        """Equal for equal specs (a compiled grammar is cached under it)."""
        return msgspec.msgpack.encode(self)


class GrammarCompiler(Protocol):
    """Compiles structured-output specs off the scheduler's thread, where the matchers use them
    (the worker implements it; ``Executor.grammar_compiler``).

    ``compile`` returns at once; the future completes when the grammar is compiled (its value
    is not the scheduler's to read), or holds the ValueError that says why the spec cannot be
    compiled. Equal specs may share one future (a cache).
    """

    def compile(self, spec: StructuredOutputsParams) -> Future: ...
