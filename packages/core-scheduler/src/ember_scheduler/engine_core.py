"""The engine core: a scheduler and an executor, stepped together."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Protocol

from ember_kv_cache import (
    AllBlocksCleared,
    BlockStored,
    KVTransferConfig,
    TieredConnectorScheduler,
    TieredKVStore,
)
from ember_scheduler.config import SchedulerConfig
from ember_scheduler.engine_types import (
    EngineCoreOutputs,
    EngineCoreRequest,
    KVBlocksRemoved,
    KVBlocksStored,
    KVCacheCleared,
    KVEvent,
)
from ember_scheduler.kv_manager import make_kv_cache_manager
from ember_scheduler.outputs import ModelRunnerOutput, SchedulerOutput
from ember_scheduler.request import Request, RequestStatus
from ember_scheduler.scheduler import Scheduler
from ember_scheduler.structured_outputs import GrammarCompiler

# How long an idle step waits for a compiling grammar before it returns (nothing to run).
_GRAMMAR_WAIT_S = 0.01
# Steps in flight under async scheduling: one running, the next scheduled behind it.
_BATCH_QUEUE_DEPTH = 2


class StepThreadCounts(Protocol):
    """How many threads a step runs with: ``large`` for large steps, ``small`` for the others."""

    large: int
    small: int


class Executor(Protocol):
    """What the engine core drives: owns the workers, the model and the KV cache tensors."""

    @property
    def num_kv_blocks(self) -> int:
        """Blocks the KV cache tensors hold, sized from the memory budget at start-up."""
        ...

    @property
    def block_size(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """Token ids the model takes: a prompt holding others is refused when admitted."""
        ...

    # Optional: ``kv_cache_specs``, one ``ember_kv_cache`` spec per layer (absent: every layer
    # full attention), from which the engine core picks its KV cache manager.

    @property
    def kv_transfer_store(self) -> TieredKVStore | None:
        """The worker's KV tier store when built with a ``kv_transfer_config``, else None."""
        ...

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """Compiles the structured-output grammars of the ranks' matchers (None: it has none)."""
        ...

    @property
    def step_threads(self) -> StepThreadCounts | None:
        """The thread counts of steps that run in this process, which the caller may change
        between steps; None where the steps run in other processes."""
        ...

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run one step; with ``non_block`` return at once with a future of its output. Steps
        run in the order they were given (async scheduling relies on it)."""
        ...

    def shutdown(self) -> None: ...


class EngineCore:
    """Owns the scheduler and drives an ``Executor``: ``add_request``, ``abort_requests``,
    ``step``.

    The KV cache manager is built from the executor's ``num_kv_blocks`` and ``block_size``, so
    the scheduler hands out exactly the blocks the executor's cache tensors hold. Requests are
    checked when admitted (token ids within the executor's ``vocab_size``), so that a bad one is
    refused alone instead of failing a step. An exception
    raised by the executor propagates out of ``step()``; the caller (the engine core process)
    turns it into an ``EngineCoreOutputs.error``. ``grammar_compiler`` (the worker's, for
    structured outputs) compiles grammars while their requests wait; without it, a request with
    ``structured_outputs`` is refused with a ValueError. With a ``kv_transfer_config`` (the one
    the executor was built with) the scheduler drives a tiered KV connector over the executor's
    ``kv_transfer_store``.

    With ``scheduler_config.async_scheduling`` each ``step()`` schedules the next step and hands
    it to the executor without blocking before it waits for the output of the step before it:
    a batch queue of depth 2, so scheduling and applying outputs run while the model runs.
    """

    def __init__(
        self,
        executor: Executor,
        scheduler_config: SchedulerConfig | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
    ) -> None:
        self.executor = executor
        config = scheduler_config if scheduler_config is not None else SchedulerConfig()
        self.kv_cache_manager = make_kv_cache_manager(executor, config, kv_transfer_config)
        connector = None
        if kv_transfer_config is not None:
            store = executor.kv_transfer_store
            if store is None:
                raise ValueError("kv_transfer_config needs an executor built with the same config")
            hasher = self.kv_cache_manager.hasher
            if store.fingerprint.hash_algo != hasher.algo:
                raise ValueError(
                    f"prefix_caching_hash_algo {hasher.algo!r} differs from the one that keys the "
                    f"executor's KV tier store ({store.fingerprint.hash_algo!r}); give both the same"
                )
            connector = TieredConnectorScheduler(
                kv_transfer_config, store, hasher, self.kv_cache_manager.specs
            )
        self.scheduler = Scheduler(config, self.kv_cache_manager, grammar_compiler, connector)
        # Steps handed to the executor whose outputs are not applied yet (async scheduling).
        self.batch_queue: deque[tuple[Future[ModelRunnerOutput], SchedulerOutput]] | None = (
            deque() if config.async_scheduling else None
        )

    @property
    def max_num_tokens(self) -> int:
        """The longest sequence a request may reach: ``max_model_len``, or the KV cache pool's
        token capacity where that is smaller."""
        return self.scheduler.max_num_tokens

    def add_request(self, request: EngineCoreRequest | Request) -> None:
        """Queue a request.

        Any failure to admit it (a duplicate id, bad input, or an unexpected error) is that
        request's alone: ValueError naming the cause, and nothing in the engine changed.
        """
        try:
            if isinstance(request, EngineCoreRequest):
                request = Request.from_engine_core_request(request)
            if max(request.all_token_ids) >= self.executor.vocab_size:
                raise ValueError(
                    f"Request.prompt_token_ids and output_token_ids of {request.request_id!r} "
                    f"must lie in [0, {self.executor.vocab_size}) (the model's vocabulary)"
                )
            self.scheduler.add_request(request)
        except ValueError:
            raise
        except Exception as exc:
            request_id = getattr(request, "request_id", None)
            raise ValueError(
                f"request {request_id!r} cannot be admitted: {type(exc).__name__}: {exc}"
            ) from exc

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Finish requests as aborted and free their KV blocks now; unknown ids are skipped."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._wait_for_steps_if_idle()

    def step(self) -> EngineCoreOutputs:
        """Schedule, run the model once, and return what changed (empty when idle)."""
        if self.batch_queue is not None:
            return self._step_with_batch_queue()
        scheduler = self.scheduler
        if not scheduler.running and not scheduler.waiting:
            # Only requests waiting for their grammars, if any: wait a little for the first.
            scheduler.poll_grammars(_GRAMMAR_WAIT_S)
            if not scheduler.waiting and not scheduler.has_kv_transfers():
                return self._with_kv_events(scheduler.take_pending_outputs())
        scheduler_output = scheduler.schedule()
        model_runner_output = self.executor.execute_model(scheduler_output)
        outputs = scheduler.update_from_output(scheduler_output, model_runner_output)
        return self._with_kv_events(outputs)

    def _step_with_batch_queue(self) -> EngineCoreOutputs:
        """Schedule a step and hand it to the executor without blocking; then, once two steps
        are in flight (or nothing more can be scheduled), wait for the older one and apply its
        output. Returns what changed (empty after a step that only scheduled)."""
        scheduler = self.scheduler
        queue = self.batch_queue
        if len(queue) < _BATCH_QUEUE_DEPTH:
            if not scheduler.running and not scheduler.waiting and not queue:
                scheduler.poll_grammars(_GRAMMAR_WAIT_S)
            # With only KV transfers pending, an empty step lets the workers report them.
            transfers_only = not queue and scheduler.has_kv_transfers()
            if scheduler.running or scheduler.waiting or transfers_only:
                scheduler_output = scheduler.schedule()
                queue.append(
                    (
                        self.executor.execute_model(scheduler_output, non_block=True),
                        scheduler_output,
                    )
                )
                if len(queue) < _BATCH_QUEUE_DEPTH and scheduler_output.total_num_scheduled_tokens:
                    return self._with_kv_events(scheduler.take_pending_outputs())
        if not queue:
            return self._with_kv_events(scheduler.take_pending_outputs())
        future, scheduler_output = queue.popleft()
        outputs = scheduler.update_from_output(scheduler_output, future.result())
        self._wait_for_steps_if_idle()
        return self._with_kv_events(outputs)

    def _wait_for_steps_if_idle(self) -> None:
        """Once no request is left, the steps still in flight ran only finished requests (the
        extra step after a stop, or aborted ones): wait for them and drop their outputs, so that
        an idle engine core holds no work."""
        queue = self.batch_queue
        while queue and not self.scheduler.has_requests():
            queue.popleft()[0].result()

    def _with_kv_events(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Attach the prefix-cache changes since the last step, consecutive ones of a kind
        batched (empty unless the config enables KV events)."""
        events: list[KVEvent] = []
        for event in self.kv_cache_manager.take_events():
            if isinstance(event, AllBlocksCleared):
                events.append(KVCacheCleared())
                continue
            kind = KVBlocksStored if isinstance(event, BlockStored) else KVBlocksRemoved
            if not events or type(events[-1]) is not kind or events[-1].group != event.group:
                events.append(kind([], event.group))
            events[-1].block_hashes.append(event.block_hash)
        outputs.kv_events = events
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
