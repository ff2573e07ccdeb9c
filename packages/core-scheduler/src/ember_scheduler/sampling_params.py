"""Sampling parameters, with the OpenAI API's and vLLM's field names, and the limits they obey."""

from __future__ import annotations

import msgspec

from ember_scheduler.structured_outputs import StructuredOutputsParams

# Integers cross the wire as msgpack int64; the worker holds per-request counts (min_tokens,
# top_k, logprobs) and token ids in int32 columns.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs
GREEDY_TEMPERATURE = 1e-5  # a temperature below this samples greedily

# Each integer field's type and inclusive range (None in the type: the field may be None).
_INT_FIELDS = {
    "n": (False, 1, INT32_MAX),
    "max_tokens": (True, 1, INT32_MAX),
    "min_tokens": (False, 0, INT32_MAX),
    "top_k": (False, -1, INT32_MAX),
    "seed": (True, INT64_MIN, INT64_MAX),
    "logprobs": (True, 0, MAX_LOGPROBS),
    "prompt_logprobs": (True, 0, MAX_LOGPROBS),
}
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """How to sample one request's outputs; validated on construction, on ``clone`` and when
    decoded (ValueError naming the field, its expected type or range, and the value).

    ``stop`` strings are matched by the front end on detokenized text; every other stop condition
    is checked by the scheduler on token ids.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        for name, (_, low, high) in _INT_FIELDS.items():
            value = getattr(self, name)
            _check(
                value is None or low <= value <= high, name, value, f"must be in [{low}, {high}]"
            )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"must not exceed max_tokens ({self.max_tokens})",
        )
        _check(
            0.0 <= self.temperature <= 100.0, "temperature", self.temperature, "must be in [0, 100]"
        )
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be in (0, 10]",
        )
        _check(all(self.stop), "stop", self.stop, "must be non-empty strings")
        _check(
            all(0 <= t <= INT32_MAX for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            f"must be token ids in [0, {INT32_MAX}]",
        )
        if self.structured_outputs is not None:
            # The grammar ends the output at EOS (or a stop token id), and only there.
            rule = "cannot be combined with structured_outputs (the grammar decides where it ends)"
            _check(not self.ignore_eos, "ignore_eos", self.ignore_eos, rule)
            _check(self.min_tokens == 0, "min_tokens", self.min_tokens, rule)

    def _check_types(self) -> None:
        """Each field holds its declared type (ints are not bools; an int passes as a float)."""
        for name, (optional, _, _) in _INT_FIELDS.items():
            value = getattr(self, name)
            if not (_is_int(value) or (optional and value is None)):
                _type_error(name, "an int or None" if optional else "an int", value)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)):
                _type_error(name, "a float", value)
            setattr(self, name, float(value))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                _type_error(name, "a bool", getattr(self, name))
        if not isinstance(self.stop, str) and not (
            isinstance(self.stop, list) and all(isinstance(s, str) for s in self.stop)
        ):
            _type_error("stop", "a string or a list of strings", self.stop)
        if not (isinstance(self.stop_token_ids, list) and all(map(_is_int, self.stop_token_ids))):
            _type_error("stop_token_ids", "a list of ints", self.stop_token_ids)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            _type_error(
                "structured_outputs", "a StructuredOutputsParams or None", self.structured_outputs
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_error(field: str, expected: str, value) -> None:
    raise ValueError(
        f"SamplingParams.{field} must be {expected}, got {type(value).__name__} {value!r}"
    )


def _check(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {rule}, got {value!r}")
