"""The scheduler's side of speculative decoding: which drafts a request verifies next step, how
the rejected ones are rolled back, and their counters.

Drafts come in the worker's output and are verified in the request's next step, no more than
``max_tokens`` and the context can still take with the target's own token after them. Under
async scheduling step n+1 is scheduled before step n's output (and drafts) arrive: a request
with a step in flight is scheduled with ``num_speculative_tokens`` draft placeholders
(``DRAFT_PLACEHOLDER``; the worker feeds the drafts it holds), and its output placeholders count
that step's drafts as accepted until the output says how many were.
"""

from __future__ import annotations

from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_types import SpecDecodingStats
from ember_scheduler.outputs import DRAFT_PLACEHOLDER
from ember_scheduler.request import Request, RequestStatus


class DraftScheduling:
    """Draft bookkeeping of one scheduler (``max_num_tokens``: its longest sequence)."""

    def __init__(self, config: SchedulerConfig, max_num_tokens: int) -> None:
        self.max_num_tokens = max_num_tokens
        # Draft slots reserved for a request whose drafts are still on the worker.
        self.num_placeholders = config.num_speculative_tokens if config.async_scheduling else 0
        self._stats: SpecDecodingStats | None = None

    def next_drafts(self, request: Request, num_known: int) -> list[int]:
        """The drafts to schedule for ``request`` (``num_known``: its tokens, placeholders of a
        step in flight included)."""
        placeholders = request.num_output_placeholders
        if not (placeholders and self.num_placeholders):
            return request.spec_token_ids
        # as many as max_tokens and the context can take after the step in flight
        room = min(
            request.max_tokens - len(request.output_token_ids) - placeholders,
            self.max_num_tokens - num_known,
        )
        return [DRAFT_PLACEHOLDER] * max(min(self.num_placeholders, room - 1), 0)

    @staticmethod
    def num_drafts_in_flight(request: Request) -> int:
        """Drafts of the request's step in flight that its computed tokens count as accepted
        (at most one step is in flight when a step is scheduled: its token, then its drafts)."""
        return max(request.num_output_placeholders - 1, 0)

    def take_output(
        self,
        request: Request,
        scheduled: list[int] | None,
        new_token_ids: list[int],
        proposed: list[int] | None,
    ) -> None:
        """Apply one output to a request that got tokens: roll back the rejected ones of its
        ``scheduled`` drafts, and keep the ``proposed`` ones it verifies next (none where a step
        in flight already took them, or where it was preempted: it resumes without drafts)."""
        running = request.status == RequestStatus.RUNNING
        if scheduled:
            num_accepted = len(new_token_ids) - 1
            num_rejected = len(scheduled) - num_accepted
            if running:  # a request preempted since has no computed tokens to uncount
                request.num_computed_tokens -= num_rejected
            if request.num_output_placeholders:
                request.num_output_placeholders -= num_rejected
            if self._stats is None:
                self._stats = SpecDecodingStats()
            self._stats.observe(len(scheduled), num_accepted)
        if proposed is None:
            return
        if request.num_output_placeholders or not running:
            request.spec_token_ids = []
            return
        room = min(
            request.max_tokens - request.num_output_tokens,
            self.max_num_tokens - request.num_tokens,
        )
        room -= len(new_token_ids) + 1
        request.spec_token_ids = proposed[: max(room, 0)]

    def take_stats(self) -> SpecDecodingStats | None:
        """Draft counters since the last call (None: no drafts verified)."""
        stats = self._stats
        self._stats = None
        return stats
