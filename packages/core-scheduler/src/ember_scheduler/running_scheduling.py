"""The first half of a step: running requests catch their computed tokens up, oldest first.

Each running request is scheduled up to its known tokens (prompt, outputs, output placeholders of
a step in flight) and the drafts it verifies, capped by ``long_prefill_token_threshold``, the
step's remaining token budget and the longest sequence. Where the KV cache cannot grow it, a
victim is preempted (``Preemption``) until it fits or is the victim itself; under the priority
policy a victim scheduled earlier in this step has its work withdrawn.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember_kv_cache import KVCacheManager
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.draft_scheduling import DraftScheduling
from ember_scheduler.outputs import CachedRequestData
from ember_scheduler.preemption import Preemption
from ember_scheduler.request import Request


@dataclass
class RunningScheduling:
    """Schedules the running requests of one scheduler (``max_num_tokens``: its longest
    sequence)."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    drafts: DraftScheduling
    preemption: Preemption
    max_num_tokens: int

    def schedule(
        self,
        running: list[Request],
        token_budget: int,
        num_scheduled_tokens: dict[str, int],
        spec_decode_tokens: dict[str, list[int]],
        cached_reqs: CachedRequestData,
        preempted_req_ids: set[str],
    ) -> int:
        """Catch ``running`` up in admission order, preempting where the cache is full (victims
        leave ``running``); returns the token budget left."""
        # Locals: this loop runs once per running request every step.
        allocate_slots = self.kv_cache_manager.allocate_slots
        threshold = self.config.long_prefill_token_threshold
        lookahead = self.config.num_lookahead_tokens
        max_num_tokens = self.max_num_tokens
        drafts = self.drafts
        preempt_victim = self.preemption.preempt_victim
        withdrew = False
        index = 0
        while index < len(running) and token_budget > 0:
            request = running[index]
            req_id = request.request_id
            num_computed = request.num_computed_tokens
            token_ids = request.all_token_ids
            num_known = len(token_ids)
            placeholders = request.num_output_placeholders
            if placeholders:
                # In flight: tokens the worker holds. Not past max_tokens or the context.
                num_known += placeholders
                if (
                    num_known >= max_num_tokens
                    or len(request.output_token_ids) + placeholders >= request.max_tokens
                ):
                    index += 1
                    continue
            spec = drafts.next_drafts(request, num_known)
            num_new = num_known + len(spec) - num_computed
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > token_budget:
                num_new = token_budget
            if num_new > max_num_tokens - num_computed:
                num_new = max_num_tokens - num_computed
            if num_new <= 0:
                index += 1
                continue
            num_lookahead = 0
            if lookahead:
                num_lookahead = min(lookahead, max_num_tokens - num_computed - num_new)

            while True:
                new_block_ids = allocate_slots(
                    req_id,
                    token_ids,
                    num_new,
                    num_computed_tokens=num_computed,
                    num_lookahead_tokens=num_lookahead,
                    extras=request.block_hash_extras,
                )
                if new_block_ids is not None:
                    break
                victim, visited = preempt_victim(running, index)
                preempted_req_ids.add(victim.request_id)
                if visited:
                    # Priority policy only: a request met earlier this step gives way.
                    index -= 1
                    withdrawn = num_scheduled_tokens.pop(victim.request_id, None)
                    if withdrawn is not None:
                        token_budget += withdrawn
                        spec_decode_tokens.pop(victim.request_id, None)
                        withdrew = True
                if victim is request:
                    break
            if new_block_ids is None:
                break

            cached_reqs.req_ids.append(req_id)
            cached_reqs.new_block_ids.append(new_block_ids)
            cached_reqs.num_computed_tokens.append(num_computed)
            if drafts.num_placeholders:
                cached_reqs.num_drafts_in_flight.append(drafts.num_drafts_in_flight(request))
            num_scheduled_tokens[req_id] = num_new
            token_budget -= num_new
            request.num_computed_tokens = num_computed + num_new
            if spec:
                num_spec = num_computed + num_new - num_known
                if num_spec > 0:
                    spec_decode_tokens[req_id] = spec if num_spec == len(spec) else spec[:num_spec]
                request.spec_token_ids = []
            index += 1

        if withdrew:
            keep = [i for i, r in enumerate(cached_reqs.req_ids) if r in num_scheduled_tokens]
            for name in ("req_ids", "new_block_ids", "num_computed_tokens", "num_drafts_in_flight"):
                column = getattr(cached_reqs, name)
                if column:
                    setattr(cached_reqs, name, [column[i] for i in keep])
        return token_budget
