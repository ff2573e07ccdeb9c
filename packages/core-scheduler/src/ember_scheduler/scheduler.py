"""The continuous-batching scheduler: one token budget per step, no prefill or decode phase.

Every step each scheduled request catches its computed tokens up to its known tokens (prompt,
outputs and draft tokens), running requests first, then waiting ones, under the step's token
budget (``max_num_batched_tokens``) and ``max_num_seqs``. A long prompt is split across steps
(chunked prefill). When the KV cache cannot grow a running request, another running request is
preempted by recompute: its blocks are freed and it goes back to the waiting queue, to be
resumed later from the prefix cache where its blocks survived.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures

from ember_kv_cache import KVCacheManager, TieredConnectorScheduler
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.draft_scheduling import DraftScheduling
from ember_scheduler.engine_types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)
from ember_scheduler.kv_transfer import KVTransferScheduling
from ember_scheduler.outputs import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ember_scheduler.request import Request, RequestStatus
from ember_scheduler.request_queue import FCFSRequestQueue, PriorityRequestQueue
from ember_scheduler.structured_outputs import GrammarCompiler

# An enum member read through its class costs a lookup per request and step; a module name does not.
_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    ``schedule()`` returns a ``SchedulerOutput`` for the executor; ``update_from_output()`` takes
    the executor's ``ModelRunnerOutput``, appends sampled tokens, applies stop conditions, frees
    finished requests and returns the step's ``EngineCoreOutputs``.

    The longest sequence a request may reach is ``max_model_len``, or less where the KV cache
    pool holds fewer tokens (``max_num_tokens``): a prompt longer than that finishes as IGNORED
    when added, and a request that reaches it finishes with LENGTH.

    A request with structured outputs waits in ``WAITING_FOR_FSM``, outside the waiting queue,
    until ``grammar_compiler`` has compiled its grammar (others keep running meanwhile); it then
    joins the queue, or finishes as aborted, with the reason, when its grammar fails to compile.

    With a ``kv_connector``, prompts continue from its tier store past the local prefix hit,
    and computed chunks are saved to it (``kv_transfer.py``).

    With ``config.async_scheduling`` the next step is scheduled before this step's output is
    applied. A request whose scheduled tokens reach the end of its known tokens will sample one:
    it gets an output placeholder, counted as a known token, so that the next step schedules the
    token the worker already holds. Its real token replaces the placeholder in
    ``update_from_output``, where stops apply as usual (a stopped request's one extra step is
    dropped there). A request is not scheduled past ``max_tokens`` or the context with its
    placeholders counted; one preempted with a step in flight still takes that step's token and
    is resumed only once it has. Drafts, with async scheduling too, follow ``DraftScheduling``.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        grammar_compiler: GrammarCompiler | None = None,
        kv_connector: TieredConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.grammar_compiler = grammar_compiler
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        if kv_cache_manager.usage != 0.0:
            raise ValueError("Scheduler needs a KVCacheManager with every block free")
        self.num_kv_blocks = kv_cache_manager.num_free_blocks
        pool_tokens = self.num_kv_blocks * self.block_size
        self.max_num_tokens = min(config.max_model_len, pool_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting = PriorityRequestQueue() if config.policy == "priority" else FCFSRequestQueue()
        self.running: list[Request] = []
        self.waiting_for_grammar: list[Request] = []
        # Requests that left the running set since the last schedule(); the worker drops them.
        self.finished_req_ids: set[str] = set()
        # Outputs of requests that finished outside a model step (ignored ones).
        self._pending_outputs: list[EngineCoreOutput] = []
        self._num_preemptions = 0
        self.kv_transfer = (
            KVTransferScheduling(kv_connector, kv_cache_manager) if kv_connector else None
        )
        self.async_scheduling = config.async_scheduling
        self.drafts = DraftScheduling(config, self.max_num_tokens)

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never fit finishes at once as IGNORED."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING:
            raise ValueError(
                f"request {request.request_id!r} is {request.status.name}, not WAITING"
            )
        spec = request.sampling_params.structured_outputs
        if spec is not None and self.grammar_compiler is None:
            raise ValueError(
                f"request {request.request_id!r} has structured_outputs, but this engine core has "
                "no grammar compiler"
            )
        if request.num_prompt_tokens > self.max_num_tokens:
            request.set_status(RequestStatus.FINISHED_IGNORED)
            if request.num_prompt_tokens > self.config.max_model_len:
                limit = f"max_model_len ({self.config.max_model_len})"
            else:
                limit = (
                    f"the KV cache capacity ({self.num_kv_blocks} blocks of "
                    f"{self.block_size} tokens)"
                )
            request.finish_detail = (
                f"prompt of {request.num_prompt_tokens} tokens is longer than {limit}"
            )
            self._pending_outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    finish_reason=FinishReason.IGNORED,
                    finish_detail=request.finish_detail,
                )
            )
            return
        self.requests[request.request_id] = request
        if spec is None:
            self.waiting.add_request(request)
            return
        request.grammar = self.grammar_compiler.compile(spec)
        request.set_status(RequestStatus.WAITING_FOR_FSM)
        self.waiting_for_grammar.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort); their KV blocks are freed at once.

        Unknown or already finished ids are skipped.
        """
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        removed_running: set[Request] = set()
        removed_compiling = False
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                removed_running.add(request)
                self._free_blocks(request)
                self.finished_req_ids.add(request_id)
            elif request.status == _WAITING_FOR_FSM:
                removed_compiling = True
            elif request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waiting.remove_request(request)
                if request.num_computed_tokens:  # a connector loaded its KV: it holds blocks
                    self.kv_cache_manager.free(request_id)
            # A request still loading keeps its blocks until the worker has written them.
            request.set_status(status)
            if self.kv_transfer is not None and request_id not in self.kv_transfer.loading:
                self.kv_transfer.request_finished(request)
        if removed_running:
            self.running = [r for r in self.running if r not in removed_running]
        if removed_compiling:
            self.waiting_for_grammar = [
                r for r in self.waiting_for_grammar if r.status == _WAITING_FOR_FSM
            ]

    def has_requests(self) -> bool:
        return (
            bool(self.running)
            or bool(self.waiting)
            or bool(self.waiting_for_grammar)
            or self.has_kv_transfers()
            or bool(self._pending_outputs)
        )

    def has_kv_transfers(self) -> bool:
        """Whether requests wait for a KV connector to load their KV, or finished requests for
        it to save theirs (the engine keeps stepping for either)."""
        return self.kv_transfer is not None and self.kv_transfer.has_transfers()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; False (and nothing done) while requests hold blocks."""
        return self.kv_cache_manager.reset_prefix_cache()

    def poll_grammars(self, timeout: float = 0.0) -> None:
        """Queue the requests whose grammar is compiled, waiting up to ``timeout`` seconds for
        the first; a request whose grammar failed finishes as aborted with the reason."""
        compiling = self.waiting_for_grammar
        if not compiling:
            return
        if timeout > 0:
            wait_futures([r.grammar for r in compiling], timeout, FIRST_COMPLETED)
        still_compiling = []
        for request in compiling:
            if not request.grammar.done():
                still_compiling.append(request)
                continue
            error = request.grammar.exception()
            request.grammar = None
            if error is None:
                request.set_status(RequestStatus.WAITING)
                self.waiting.add_request(request)
                continue
            request.set_status(RequestStatus.FINISHED_ABORTED)
            request.finish_detail = str(error)
            del self.requests[request.request_id]
            self._pending_outputs.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    finish_reason=FinishReason.ABORT,
                    finish_detail=request.finish_detail,
                )
            )
        self.waiting_for_grammar = still_compiling

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        self.poll_grammars()
        token_budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        spec_decode_tokens: dict[str, list[int]] = {}
        cached_reqs = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted_req_ids: set[str] = set()
        token_budget = self._schedule_running(
            token_budget, num_scheduled_tokens, spec_decode_tokens, cached_reqs, preempted_req_ids
        )
        # Waiting requests are admitted only in a step that preempted nothing: a preemption
        # means the cache is full, and admitting would only evict what is about to run.
        if not preempted_req_ids:
            token_budget = self._schedule_waiting(token_budget, new_reqs, num_scheduled_tokens)

        num_common_prefix_blocks = 0
        if self.running:
            num_common_prefix_blocks = self.kv_cache_manager.get_num_common_prefix_blocks(
                self.running[0].request_id, len(self.running)
            )
        if self.async_scheduling:
            self._add_output_placeholders(num_scheduled_tokens, spec_decode_tokens)
        finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        kv_connector_metadata = None
        if self.kv_transfer is not None:
            kv_connector_metadata = self.kv_transfer.build_connector_meta(
                self.running, num_scheduled_tokens
            )
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - token_budget,
            scheduled_spec_decode_tokens=spec_decode_tokens,
            num_common_prefix_blocks=num_common_prefix_blocks,
            finished_req_ids=finished_req_ids,
            preempted_req_ids=preempted_req_ids,
            kv_connector_metadata=kv_connector_metadata,
            kv_block_copies=self.kv_cache_manager.take_block_copies(),
        )

    def _schedule_running(
        self,
        token_budget: int,
        num_scheduled_tokens: dict[str, int],
        spec_decode_tokens: dict[str, list[int]],
        cached_reqs: CachedRequestData,
        preempted_req_ids: set[str],
    ) -> int:
        """Catch running requests up in admission order, preempting where the cache is full."""
        # Locals: this loop runs once per running request every step.
        allocate_slots = self.kv_cache_manager.allocate_slots
        threshold = self.config.long_prefill_token_threshold
        lookahead = self.config.num_lookahead_tokens
        max_num_tokens = self.max_num_tokens
        drafts = self.drafts
        running = self.running
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
                victim, visited = self._preempt_victim(index)
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

    def _schedule_waiting(
        self,
        token_budget: int,
        new_reqs: list[NewRequestData],
        num_scheduled_tokens: dict[str, int],
    ) -> int:
        """Admit waiting requests in queue order while budget, seats and blocks last."""
        kv = self.kv_cache_manager
        config = self.config
        while self.waiting and token_budget > 0 and len(self.running) < config.max_num_seqs:
            request = self.waiting.peek_request()
            if request.num_output_placeholders:
                break  # preempted with a step in flight: resumed once its token is known
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
                        self.waiting.pop_request()
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
            self.waiting.pop_request()
            self.running.append(request)
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
                )
            )
            num_scheduled_tokens[req_id] = num_new
            token_budget -= num_new
            request.num_computed_tokens = num_computed + num_new
        return token_budget

    def _free_blocks(self, request: Request) -> None:
        """Free a finished request's blocks; the KV cache manager may keep its last, partly
        filled block findable by prefix (not while a step in flight has a token for it that it
        does not know yet: every step that wrote its KV runs before a step that copies it)."""
        if request.num_output_placeholders:
            self.kv_cache_manager.free(request.request_id)
            return
        # Accepted draft tokens after a stop are computed but dropped from the request.
        tokens = request.all_token_ids
        num_computed = min(request.num_computed_tokens, len(tokens))
        self.kv_cache_manager.free(request.request_id, tokens, num_computed)

    def _preempt_victim(self, current: int) -> tuple[Request, bool]:
        """Preempt the running request the policy picks (the newest under FCFS; the lowest
        priority, latest arrival under ``policy="priority"``).

        Returns the victim and whether it sat before ``running[current]``, that is, whether this
        step already visited it.
        """
        running = self.running
        if self.config.policy == "priority":
            victim = max(running, key=lambda r: (r.priority, r.arrival_time))
            position = running.index(victim)
        else:
            victim, position = running[-1], len(running) - 1
        del running[position]
        # Not _free_blocks: tokens this step scheduled for it never run, so its last block's
        # KV may be short of what num_computed_tokens says.
        self.kv_cache_manager.free(victim.request_id)
        victim.set_status(RequestStatus.PREEMPTED)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend_request(victim)
        return victim, position < current

    def _add_output_placeholders(
        self, num_scheduled_tokens: dict[str, int], spec_decode_tokens: dict[str, list[int]]
    ) -> None:
        """Give placeholders to each request scheduled to sample: its tokens reach the end of
        its known tokens and its drafts (async scheduling; after the whole step, so withdrawn
        requests have none). One for its token, one per draft: drafts count as accepted until
        the output says otherwise."""
        requests = self.requests
        for req_id in num_scheduled_tokens:
            request = requests[req_id]
            placeholders = request.num_output_placeholders
            num_drafts = len(spec_decode_tokens.get(req_id, ()))
            if (
                request.num_computed_tokens
                == len(request.all_token_ids) + placeholders + num_drafts
                and request.pooling_params is None
            ):
                request.num_output_placeholders = placeholders + 1 + num_drafts

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply one step's sampled tokens; returns what changed for each request."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        sampled_token_ids = model_runner_output.sampled_token_ids
        spec_token_ids = model_runner_output.spec_token_ids
        scheduled_spec = scheduler_output.scheduled_spec_decode_tokens
        prompt_logprobs = model_runner_output.prompt_logprobs
        logprobs = model_runner_output.logprobs
        logprob_offsets = None
        if logprobs is not None:
            logprob_offsets = list(
                itertools.accumulate((len(t) for t in sampled_token_ids), initial=0)
            )
        pooler_output = model_runner_output.pooler_output
        finished: list[Request] = []
        finished_preempted: list[Request] = []

        for index, req_id in enumerate(model_runner_output.req_ids):
            request = self.requests.get(req_id)
            if request is None:
                continue  # finished or aborted since it was scheduled
            status = request.status
            if status != _RUNNING and status != _PREEMPTED:
                continue
            # PREEMPTED: preempted while this step was in flight (async scheduling); it keeps
            # the step's token.
            if request.pooling_params is not None:
                pooled = pooler_output.get(req_id)
                if pooled is not None:  # else a prefill chunk: nothing to report yet
                    outputs.append(_finish_pooled(request, pooled))
                    (finished if status == _RUNNING else finished_preempted).append(request)
                continue
            new_token_ids = sampled_token_ids[index]
            finish_reason = None
            if new_token_ids:
                if request.num_output_placeholders:
                    request.num_output_placeholders -= len(new_token_ids)
                self.drafts.take_output(
                    request,
                    scheduled_spec.get(req_id),
                    new_token_ids,
                    None if spec_token_ids is None else spec_token_ids[index],
                )
                new_token_ids, finish_reason = self._append_until_stop(request, new_token_ids)

            new_logprobs = None
            if logprob_offsets is not None and request.sampling_params.logprobs is not None:
                new_logprobs = _slice_rows(logprobs, logprob_offsets[index], len(new_token_ids))
            new_prompt_logprobs = None
            if prompt_logprobs:
                chunk = prompt_logprobs.get(req_id)
                if chunk is not None:
                    new_prompt_logprobs = self._unseen_prompt_logprobs(request, chunk)

            if finish_reason is not None:
                request.set_status(
                    RequestStatus.FINISHED_STOPPED
                    if finish_reason == FinishReason.STOP
                    else RequestStatus.FINISHED_LENGTH_CAPPED
                )
                (finished if status == _RUNNING else finished_preempted).append(request)
            elif not new_token_ids and new_prompt_logprobs is None:
                continue  # a prefill chunk: nothing to report yet
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_token_ids,
                    new_logprobs,
                    new_prompt_logprobs,
                    finish_reason,
                    request.stop_reason,
                    request.num_cached_tokens,
                )
            )

        if finished:
            for request in finished:
                if self.kv_transfer is None:
                    self._free_blocks(request)
                else:
                    self.kv_transfer.free_after_save(request)
                del self.requests[request.request_id]
                self.finished_req_ids.add(request.request_id)
            self.running = [r for r in self.running if r.status == _RUNNING]
        for request in finished_preempted:
            # Its blocks were freed and the worker dropped it when it was preempted.
            self.waiting.remove_request(request)
            del self.requests[request.request_id]
        if self.kv_transfer is not None:
            for request in self.kv_transfer.update_from_output(
                model_runner_output.kv_connector_output
            ):
                self.waiting.prepend_request(request)
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.time()
        )

    def _append_until_stop(
        self, request: Request, new_token_ids: list[int]
    ) -> tuple[list[int], FinishReason | None]:
        """Append sampled tokens up to the first that ends the request.

        Returns the tokens kept (those after a stop are dropped) and the finish reason, if any.
        """
        output_ids = request.output_token_ids
        all_ids = request.all_token_ids
        eos_token_id = request.eos_token_id
        for count, token in enumerate(new_token_ids, 1):
            output_ids.append(token)
            all_ids.append(token)
            num_outputs = len(output_ids)
            # The worker's sampler cannot pick EOS or a stop id before min_tokens outputs; the
            # min_tokens test holds the rule for an executor that does not mask (as vLLM's
            # check_stop does).
            if (
                token == eos_token_id or token in request.stop_token_ids
            ) and num_outputs >= request.min_tokens:
                if token != eos_token_id:
                    request.stop_reason = token
                return new_token_ids[:count], FinishReason.STOP
            if num_outputs >= request.max_tokens or len(all_ids) >= self.max_num_tokens:
                return new_token_ids[:count], FinishReason.LENGTH
        return new_token_ids, None

    def _unseen_prompt_logprobs(self, request: Request, chunk: Logprobs) -> Logprobs | None:
        """Drop prompt-logprob rows already sent before a preemption made the worker redo them."""
        seen = request.num_prompt_logprob_rows_seen
        rows = len(chunk.ranks)
        request.num_prompt_logprob_rows_seen = seen + rows
        skip = request.num_prompt_logprob_rows_sent - seen
        if skip <= 0:
            request.num_prompt_logprob_rows_sent += rows
            return chunk
        if skip >= rows:
            return None
        request.num_prompt_logprob_rows_sent += rows - skip
        return Logprobs(chunk.token_ids[skip:], chunk.logprobs[skip:], chunk.ranks[skip:])

    def take_pending_outputs(self) -> EngineCoreOutputs:
        """Outputs produced outside a model step (ignored requests), with current stats."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.time()
        )

    def make_stats(self) -> SchedulerStats:
        """Gauges now, and counters since the previous call."""
        prefix = self.kv_cache_manager.take_prefix_cache_stats()
        num_preemptions = self._num_preemptions
        self._num_preemptions = 0
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=(
                len(self.waiting)
                + len(self.waiting_for_grammar)
                + (len(self.kv_transfer.loading) if self.kv_transfer else 0)
            ),
            num_unfinished_reqs=len(self.requests),
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=num_preemptions,
            kv_connector_stats=self.kv_transfer.take_stats() if self.kv_transfer else None,
            spec_decoding=self.drafts.take_stats(),
        )


def _may_skip_cached_prompt(request: Request) -> bool:
    """Whether prefix-cache hits may replace computing the prompt: not when prompt logprobs
    need logits at every position, nor when pooling reads positions before the last."""
    if request.pooling_params is not None:
        return request.pooling_params.uses_prefix_cache
    return request.sampling_params.prompt_logprobs is None


def _finish_pooled(request: Request, pooled: bytes) -> EngineCoreOutput:
    """A pooling request ends with its prompt: STOP, carrying the pooled vector."""
    request.set_status(RequestStatus.FINISHED_STOPPED)
    return EngineCoreOutput(
        request.request_id,
        [],
        finish_reason=FinishReason.STOP,
        num_cached_tokens=request.num_cached_tokens,
        pooling_output=pooled,
    )


def _slice_rows(logprobs: Logprobs, start: int, count: int) -> Logprobs:
    """One request's ``count`` sampled-token rows of the step's logprobs, from ``start``."""
    end = start + count
    return Logprobs(
        logprobs.token_ids[start:end], logprobs.logprobs[start:end], logprobs.ranks[start:end]
    )
