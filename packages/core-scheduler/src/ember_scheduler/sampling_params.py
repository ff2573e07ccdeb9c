"""Sampling parameters, with the OpenAI API's and vLLM's field names."""

from __future__ import annotations

import msgspec

_MAX_LOGPROBS = 20


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
    """How to sample one request's outputs; validated on construction (ValueError names the field).

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", self.n, "must be at least 1")
        _check(
            self.seed is None or -(2**63) <= self.seed < 2**63,
            "seed",
            self.seed,
            "must fit in a signed 64-bit integer",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "must be at least 1",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be at least 0")
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
        _check(self.top_k >= 0, "top_k", self.top_k, "must be -1, 0 (disabled) or positive")
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
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or 0 <= value <= _MAX_LOGPROBS,
                name,
                value,
                f"must be in [0, {_MAX_LOGPROBS}]",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            self.stop,
            "must be non-empty strings",
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "must be non-negative token ids",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, field: str, value, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{field} {rule}, got {value!r}")
