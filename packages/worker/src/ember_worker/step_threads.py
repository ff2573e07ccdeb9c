"""torch's intra-op thread count per model step."""

from __future__ import annotations

import torch

from ember_scheduler.config import check_int

# A step needs at least this many scheduled tokens to count as a large step.
LARGE_STEP_MIN_TOKENS = 256


class StepThreads:
    """How many torch intra-op threads a model step runs with: ``large`` for a step of at least
    ``large_min_tokens`` scheduled tokens (a prefill chunk, or that many decodes), ``small``
    (default: ``large``) for smaller ones.

    A small step's work is too short to pay for waking another thread at each of its many
    parallel regions, and a served engine's front end wants a core while it streams the step's
    tokens: a served engine takes every core for large steps only. ``apply`` sets the count in
    the thread that runs the step (OpenMP keeps it per calling thread, so a count set elsewhere
    would not reach a forward run in another thread) and only when it changes.
    """

    def __init__(
        self, large: int, small: int | None = None, large_min_tokens: int = LARGE_STEP_MIN_TOKENS
    ) -> None:
        small = large if small is None else small
        check_int("num_threads", large)
        check_int("small_num_threads", small)
        check_int("large_step_min_tokens", large_min_tokens)
        self.large = large
        self.small = small
        self.large_min_tokens = large_min_tokens

    def apply(self, num_tokens: int) -> None:
        """Set this thread's torch threads for a step of ``num_tokens`` scheduled tokens."""
        wanted = self.large if num_tokens >= self.large_min_tokens else self.small
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

    def __repr__(self) -> str:
        return (
            f"StepThreads(large={self.large}, small={self.small}, "
            f"large_min_tokens={self.large_min_tokens})"
        )
