"""Preemption by recompute: when the KV cache cannot grow a running request, a victim gives way.

The victim is the newest running request (FCFS), or the lowest priority, latest arrival
(``policy="priority"``). Its blocks are freed, its computed tokens and drafts forgotten, and it
waits at the front of the waiting queue; admission resumes it as a new request with its outputs
so far, reusing from the prefix cache whatever of its blocks survived.
"""

from __future__ import annotations

from ember_kv_cache import KVCacheManager
from ember_scheduler.request import Request, RequestStatus
from ember_scheduler.request_queue import RequestQueue


class Preemption:
    """Preempts running requests of one scheduler and counts the preemptions."""

    def __init__(
        self, policy: str, kv_cache_manager: KVCacheManager, waiting: RequestQueue
    ) -> None:
        self.by_priority = policy == "priority"
        self.kv_cache_manager = kv_cache_manager
        self.waiting = waiting
        self._num_preemptions = 0

    def preempt_victim(self, running: list[Request], current: int) -> tuple[Request, bool]:
        """Preempt the running request the policy picks, taking it out of ``running``.

        Returns the victim and whether it sat before ``running[current]``, that is, whether this
        step already visited it.
        """
        if self.by_priority:
            victim = max(running, key=lambda r: (r.priority, r.arrival_time))
            position = running.index(victim)
        else:
            victim, position = running[-1], len(running) - 1
        del running[position]
        # Not the scheduler's free of a finished request: tokens this step scheduled for it never
        # run, so its last block's KV may be short of what num_computed_tokens says.
        self.kv_cache_manager.free(victim.request_id)
        victim.set_status(RequestStatus.PREEMPTED)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend_request(victim)
        return victim, position < current

    def take_num_preemptions(self) -> int:
        """Preemptions since the last call."""
        num_preemptions = self._num_preemptions
        self._num_preemptions = 0
        return num_preemptions
