"""The message that names the first bad token count of an allocation."""

from __future__ import annotations

import numbers


def bad_counts(num_new_tokens, num_computed_tokens, num_lookahead_tokens) -> str:
    """The message naming the first token count that is not an int >= 0."""
    for name, value in (
        ("num_new_tokens", num_new_tokens),
        ("num_computed_tokens", num_computed_tokens),
        ("num_lookahead_tokens", num_lookahead_tokens),
    ):
        if not isinstance(value, numbers.Integral) or value < 0:
            return f"{name} must be an int >= 0, got {value!r}"
    raise AssertionError("every count is an int >= 0")
