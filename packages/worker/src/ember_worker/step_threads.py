"""torch's intra-op thread count per model step."""

from __future__ import annotations

import torch

# A step needs at least this many scheduled tokens to count as a prefill step.
PREFILL_MIN_TOKENS = 256


class StepThreads:
    """How many torch intra-op threads a model step runs with: ``prefill`` for a prefill step (at
    least ``prefill_min_tokens`` scheduled tokens and no request past its prompt), ``decode``
    (default: ``prefill``) for the others.

    A step with decoding requests is one whose tokens a front end process streams while the next
    step runs, so a served engine can leave that process its core there and take every core for
    prefill steps only. ``apply`` sets the count in the thread that runs the step (OpenMP keeps
    it per calling thread, so a count set elsewhere would not reach a forward run in another
    thread) and only when it changes.
    """

    def __init__(
        self, prefill: int, decode: int | None = None, prefill_min_tokens: int = PREFILL_MIN_TOKENS
    ) -> None:
        decode = prefill if decode is None else decode
        for name, value in (("num_threads", prefill), ("decode_num_threads", decode)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.prefill = prefill
        self.decode = decode
        self.prefill_min_tokens = prefill_min_tokens

    def apply(self, num_tokens: int, num_decoding: int) -> None:
        """Set this thread's torch threads for a step of ``num_tokens`` scheduled tokens, of which
        ``num_decoding`` requests are past their prompts."""
        prefill = num_tokens >= self.prefill_min_tokens and num_decoding == 0
        wanted = self.prefill if prefill else self.decode
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def __repr__(self) -> str:
        return (
            f"StepThreads(prefill={self.prefill}, decode={self.decode}, "
            f"prefill_min_tokens={self.prefill_min_tokens})"
        )
