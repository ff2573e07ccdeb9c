"""The continuous-batching scheduler: one token budget per step, no prefill or decode phase.

Every step each scheduled request catches its computed tokens up to its known tokens (prompt,
outputs and draft tokens), running requests first, then waiting ones, under the step's token
budget (``max_num_batched_tokens``) and ``max_num_seqs``. A long prompt is split across steps
(chunked prefill). When the KV cache cannot grow a running request, another running request is
preempted by recompute: its blocks are freed and it goes back to the waiting queue, to be
resumed later from the prefix cache where its blocks survived.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ember_kv_cache import KVCacheManager, TieredConnectorScheduler, max_tokens_per_request
from ember_scheduler.admission import WaitingAdmission
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.draft_scheduling import DraftScheduling
from ember_scheduler.engine_types import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    LoRAStats,
    SchedulerStats,
)
from ember_scheduler.grammar_waiting import GrammarWaiting
from ember_scheduler.kv_transfer import KVTransferScheduling
from ember_scheduler.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from ember_scheduler.preemption import Preemption
from ember_scheduler.request import Request, RequestStatus
from ember_scheduler.request_queue import FCFSRequestQueue, PriorityRequestQueue
from ember_scheduler.running_scheduling import RunningScheduling
from ember_scheduler.step_outputs import StepOutputApplier
from ember_scheduler.structured_outputs import GrammarCompiler

# An enum member read through its class costs a lookup per request and step; a module name does not.
_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Decides, step by step, which requests run and how many tokens each computes.

    ``schedule()`` returns a ``SchedulerOutput`` for the executor; ``update_from_output()`` takes
    the executor's ``ModelRunnerOutput``, appends sampled tokens, applies stop conditions, frees
    finished requests and returns the step's ``EngineCoreOutputs``.

    The longest sequence a request may reach is ``max_model_len``, or less where the KV cache
    pool holds fewer tokens (``max_num_tokens``): a prompt longer than that finishes as IGNORED
    when added, and a request that reaches it finishes with LENGTH.

    A step schedules the running requests first (``RunningScheduling``, which preempts through
    ``Preemption`` where the KV cache is full), then admits waiting ones (``WaitingAdmission``);
    ``StepOutputApplier`` applies the model's output to them.

    A request with structured outputs waits in ``WAITING_FOR_FSM``, outside the waiting queue,
    until ``grammar_compiler`` has compiled its grammar (others keep running meanwhile); it then
    joins the queue, or finishes as aborted, with the reason, when its grammar fails to compile
    (``GrammarWaiting``).

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
        self.kv_cache_manager = kv_cache_manager
        self.block_size = kv_cache_manager.block_size
        if kv_cache_manager.usage != 0.0:
            raise ValueError("Scheduler needs a KVCacheManager with every block free")
        self.num_kv_blocks = kv_cache_manager.num_free_blocks
        # One request alone always fits in this many tokens (any length: window models).
        pool_tokens = max_tokens_per_request(
            kv_cache_manager.specs,
            self.num_kv_blocks,
            self.block_size,
            config.max_num_batched_tokens + config.num_lookahead_tokens,
        )
        if pool_tokens is None:
            pool_tokens = config.max_model_len
        self.max_num_tokens = min(config.max_model_len, pool_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting = PriorityRequestQueue() if config.policy == "priority" else FCFSRequestQueue()
        self.running: list[Request] = []
        self.waiting_for_grammar = GrammarWaiting(grammar_compiler)
        # Requests that left the running set since the last schedule(); the worker drops them.
        self.finished_req_ids: set[str] = set()
        # Outputs of requests that finished outside a model step (ignored ones, failed grammars).
        self._pending_outputs: list[EngineCoreOutput] = []
        self.kv_transfer = (
            KVTransferScheduling(kv_connector, kv_cache_manager) if kv_connector else None
        )
        self.async_scheduling = config.async_scheduling
        self.drafts = DraftScheduling(config, self.max_num_tokens)
        self.preemption = Preemption(config.policy, kv_cache_manager, self.waiting)
        self.running_scheduling = RunningScheduling(
            config, kv_cache_manager, self.drafts, self.preemption, self.max_num_tokens
        )
        self.admission = WaitingAdmission(
            config, kv_cache_manager, self.kv_transfer, self.max_num_tokens
        )
        self.step_outputs = StepOutputApplier(self.drafts, self.max_num_tokens)

    # ---------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request; one that can never fit finishes at once as IGNORED."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.status != RequestStatus.WAITING:
            raise ValueError(
                f"request {request.request_id!r} is {request.status.name}, not WAITING"
            )
        self.waiting_for_grammar.check_supported(request)
        if request.lora_request is not None and self.config.lora is None:
            raise ValueError(
                f"request {request.request_id!r} has a lora_request, but LoRA is not enabled "
                "(enable_lora)"
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
            self._report_unscheduled(request, FinishReason.IGNORED)
            return
        self.requests[request.request_id] = request
        if request.sampling_params.structured_outputs is None:
            self.waiting.add_request(request)
        else:
            self.waiting_for_grammar.start(request)

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
            elif request.status == RequestStatus.WAITING_FOR_FSM:
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
            self.waiting_for_grammar.drop_finished()

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
        ready, failed = self.waiting_for_grammar.poll(timeout)
        for request in ready:
            self.waiting.add_request(request)
        for request in failed:
            del self.requests[request.request_id]
            self._report_unscheduled(request, FinishReason.ABORT)

    def _report_unscheduled(self, request: Request, finish_reason: FinishReason) -> None:
        """Report a request that finished outside a model step, with its ``finish_detail``."""
        self._pending_outputs.append(
            EngineCoreOutput(
                request.request_id,
                [],
                finish_reason=finish_reason,
                finish_detail=request.finish_detail,
            )
        )

    # ---------------------------------------------------------------- one step

    def schedule(self) -> SchedulerOutput:
        self.poll_grammars()
        token_budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        spec_decode_tokens: dict[str, list[int]] = {}
        cached_reqs = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        preempted_req_ids: set[str] = set()
        token_budget = self.running_scheduling.schedule(
            self.running,
            token_budget,
            num_scheduled_tokens,
            spec_decode_tokens,
            cached_reqs,
            preempted_req_ids,
        )
        # Waiting requests are admitted only in a step that preempted nothing: a preemption
        # means the cache is full, and admitting would only evict what is about to run.
        if not preempted_req_ids:
            token_budget = self.admission.admit(
                self.waiting, self.running, token_budget, new_reqs, num_scheduled_tokens
            )

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
        finished, finished_preempted = self.step_outputs.apply(
            scheduler_output, model_runner_output, self.requests, outputs
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

    def take_pending_outputs(self) -> EngineCoreOutputs:
        """Outputs produced outside a model step (ignored requests, failed grammars), with
        current stats."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(), timestamp=time.time()
        )

    def make_stats(self) -> SchedulerStats:
        """Gauges now, and counters since the previous call."""
        prefix = self.kv_cache_manager.take_prefix_cache_stats()
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
            num_preemptions=self.preemption.take_num_preemptions(),
            kv_connector_stats=self.kv_transfer.take_stats() if self.kv_transfer else None,
            spec_decoding=self.drafts.take_stats(),
            lora=None if self.config.lora is None else self._lora_stats(),
        )

    def _lora_stats(self) -> LoRAStats:
        def names(requests) -> list[str]:
            return list(dict.fromkeys(r.lora_name for r in requests if r.lora_name is not None))

        return LoRAStats(self.config.lora.max_loras, names(self.running), names(self.waiting))
