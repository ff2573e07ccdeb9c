"""The second half of a step: waiting requests are admitted in queue order.

A request is admitted while the step has token budget, a seat (``max_num_seqs``) and KV blocks
for it. Its prompt skips what the prefix cache holds (unless prompt logprobs or its pooling need
every position), then what a KV connector can load, in which case it waits for that load outside
the queue; the rest is computed, chunked under the budget. A preempted request resumes here as a
new request with its outputs so far, once no step in flight still owes it a token.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember_kv_cache import KVCacheManager
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.kv_transfer import KVTransferScheduling
from ember_scheduler.lora_seats import AdapterSeats
from ember_scheduler.outputs import NewRequestData
from ember_scheduler.request import Request, RequestStatus
from ember_scheduler.request_queue import RequestQueue


@dataclass
class WaitingAdmission:
    """Admits the waiting requests of one scheduler (``max_num_tokens``: its longest
    sequence)."""

    config: SchedulerConfig
    kv_cache_manager: KVCacheManager
    kv_transfer: KVTransferScheduling | None
    max_num_tokens: int

    def admit(
        self,
        waiting: RequestQueue,
        running: list[Request],
        token_budget: int,
        new_reqs: list[NewRequestData],
        num_scheduled_tokens: dict[str, int],
    ) -> int:
        """Move requests from ``waiting`` to ``running`` while budget, seats and blocks last;
        returns the token budget left."""
        kv = self.kv_cache_manager
        config = self.config
        adapters = AdapterSeats.of(config, running)
        skipped: list[Request] = []
        while waiting and token_budget > 0 and len(running) < config.max_num_seqs:
            request = waiting.peek_request()
            if request.num_output_placeholders:
                break  # preempted with a step in flight: resumed once its token is known
            if not adapters.has_seat(request):
                skipped.append(waiting.pop_request())  # waits; the requests behind it go on
                continue
            req_id = request.request_id
            token_ids = request.all_token_ids
            computed = None
            # Nonzero only for a request whose KV a connector loaded: it holds its blocks.
            num_computed = request.num_computed_tokens
            if (
                not num_computed
                and config.enable_prefix_caching
                and _may_skip_cached_prompt(request)
            ):
                computed = kv.get_computed_blocks(req_id, token_ids, request.block_hash_extras)
                if self.kv_transfer is not None:
                    loading = self.kv_transfer.start_load(request, computed)
                    if loading is None:
                        break
                    if loading:
                        waiting.pop_request()
                        continue
                num_computed = computed.num_computed_tokens
            num_new = len(token_ids) - num_computed
            if 0 < config.long_prefill_token_threshold < num_new:
                num_new = config.long_prefill_token_threshold
            if num_new > token_budget:
                if not config.enable_chunked_prefill:
                    break
                num_new = token_budget
            num_lookahead = 0
            if config.num_lookahead_tokens:
                num_lookahead = min(
                    config.num_lookahead_tokens, self.max_num_tokens - num_computed - num_new
                )
            new_block_ids = kv.allocate_slots(
                req_id,
                token_ids,
                num_new,
                num_computed_tokens=0 if computed is not None else num_computed,
                computed=computed,
                num_lookahead_tokens=num_lookahead,
                extras=request.block_hash_extras,
            )
            if new_block_ids is None:
                break
            waiting.pop_request()
            running.append(request)
            request.set_status(RequestStatus.RUNNING)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
            # The worker recomputes prompt logprobs from the start; rows already sent are skipped.
            request.num_prompt_logprob_rows_seen = 0
            new_reqs.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(req_id),
                    num_computed_tokens=num_computed,
                    eos_token_id=request.eos_token_id,
                    pooling_params=request.pooling_params,
                    lora_request=request.lora_request,
                )
            )
            num_scheduled_tokens[req_id] = num_new
            token_budget -= num_new
            request.num_computed_tokens = num_computed + num_new
            adapters.take(request)
        for request in reversed(skipped):
            waiting.prepend_request(request)
        return token_budget


def _may_skip_cached_prompt(request: Request) -> bool:
    """Whether prefix-cache hits may replace computing the prompt: not when prompt logprobs
    need logits at every position, nor when pooling reads positions before the last."""
    if request.pooling_params is not None:
        return request.pooling_params.uses_prefix_cache
    return request.sampling_params.prompt_logprobs is None
