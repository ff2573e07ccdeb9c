"""torch's intra-op thread count per model step."""

from __future__ import annotations

import torch

# A step needs at least this many scheduled tokens to count as a large step.
LARGE_STEP_MIN_TOKENS = 256


class StepThreads:
    """How many torch intra-op threads a model step runs with: ``prefill`` for a large step (at
    least ``prefill_min_tokens`` scheduled tokens: a prefill chunk, or that many decodes),
    ``decode`` (default: ``prefill``) for smaller ones.

    A small step's work is too short to pay for waking another thread at each of its many
    parallel regions, and a served engine's front end wants a core while it streams the step's
    tokens: a served engine takes every core for large steps only. ``apply`` sets the count in the thread that runs the step (OpenMP keeps
    it per calling thread, so a count set elsewhere would not reach a forward run in another
    thread) and only when it changes.
    """

    def __init__(
        self,
        prefill: int,
        decode: int | None = None,
        prefill_min_tokens: int = LARGE_STEP_MIN_TOKENS,
    ) -> None:
        decode = prefill if decode is None else decode
        for name, value in (("num_threads", prefill), ("decode_num_threads", decode)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.prefill = prefill
        self.decode = decode
        self.prefill_min_tokens = prefill_min_tokens

    def apply(self, num_tokens: int) -> None:
        """Set this thread's torch threads for a step of ``num_tokens`` scheduled tokens."""
        wanted = self.prefill if num_tokens >= self.prefill_min_tokens else self.decode
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def __repr__(self) -> str:
        return (
            f"StepThreads(prefill={self.prefill}, decode={self.decode}, "
            f"prefill_min_tokens={self.prefill_min_tokens})"
        )
