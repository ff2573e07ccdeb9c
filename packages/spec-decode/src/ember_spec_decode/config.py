"""The speculative decoding settings, as vLLM's ``speculative_config`` dict spells them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_NUM_SPECULATIVE_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many per step.

    ``method="ngram"``: prompt lookup, matching the last ``prompt_lookup_min`` to
    ``prompt_lookup_max`` tokens of a request against its own earlier tokens (when only one bound
    is given the other takes its value; neither: both 5, as vLLM). ``method="draft_model"``:
    ``model`` is a smaller Hugging Face model with the target's vocabulary, run by the worker.
    Validated on construction (ValueError names the field).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {METHODS}, got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if (
            not isinstance(k, int)
            or isinstance(k, bool)
            or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS
        ):
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an int in "
                f"[1, {MAX_NUM_SPECULATIVE_TOKENS}], got {k!r}"
            )
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model is only for method 'draft_model'")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
                if value is not None and (
                    not isinstance(value, int) or isinstance(value, bool) or value < 1
                ):
                    raise ValueError(
                        f"speculative_config.{name} must be a positive int, got {value!r}"
                    )
            if low is None and high is None:
                low = high = 5
            low = high if low is None else low
            high = low if high is None else high
            if low > high:
                raise ValueError(
                    f"speculative_config.prompt_lookup_min ({low}) must not exceed "
                    f"prompt_lookup_max ({high})"
                )
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
        else:
            if not self.model:
                raise ValueError(
                    "speculative_config.model must name the draft model's folder for method "
                    "'draft_model'"
                )
            object.__setattr__(self, "model", str(self.model))
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} is only for method 'ngram'")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict (``{"method": "ngram", "num_speculative_tokens": 4, ...}``)."""
        if isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, Mapping):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {sorted(fields)}"
            )
        for name in ("method", "num_speculative_tokens"):
            if name not in values:
                raise ValueError(f"speculative_config.{name} is required")
        return cls(**values)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a drafter writes past the scheduled tokens: a draft model writes the KV of
        its own drafts; prompt lookup writes none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0
