"""The asynchronous front end for serving: ``AsyncLLM`` over one or more engine core processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import AsyncIterator

from ember_kv_cache import BlockHasher, BlockHashExtras
from ember_scheduler.engine_types import EngineCoreRequest, SchedulerStats
from ember_scheduler.lora import LoRARequest
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.admission import AdmissionControl, next_before
from ember_server.engine.core_client import AsyncMPClient, EngineDeadError, launch_engines
from ember_server.engine.data_parallel import DataParallelRouter, RouteDecision
from ember_server.engine.engine_args import EngineArgs
from ember_server.engine.input_processor import InputProcessor, PromptType
from ember_server.engine.lockstep import spans_engines
from ember_server.engine.metrics import EngineMetrics, IterationStats
from ember_server.engine.model_config import ModelConfig
from ember_server.engine.output_collector import RequestOutputCollector
from ember_server.engine.output_processor import OutputProcessor
from ember_server.engine.outputs import RequestOutput, RequestOutputKind
from ember_server.engine.pooling_outputs import PoolingRequestOutput
from ember_server.engine.recovery import EngineRecovery
from ember_server.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Tokenizes, detokenizes and streams in the event loop; each engine core runs in its own
    process (``data_parallel_size`` of them, routed by ``DataParallelRouter``).

    Build it with ``await AsyncLLM.start(args)`` inside the event loop that will use it. If an
    engine process dies, it is restarted and its requests move on (``recovery``); past
    ``max_engine_restarts`` its in-flight requests raise ``EngineDeadError`` and the others go
    on; once no engine is left, ``errored`` turns true and new requests are refused.
    """

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        tokenizer,
        clients: list[AsyncMPClient],
        metrics: EngineMetrics,
    ) -> None:
        self.engine_args = args
        # The engine cores may have lowered max_model_len to what their KV caches hold.
        max_model_len = min(client.ready.max_model_len for client in clients)
        model_config = dataclasses.replace(model_config, max_model_len=max_model_len)
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.clients = clients
        self.metrics = metrics
        ready = clients[0].ready
        self.input_processor = InputProcessor(
            tokenizer,
            model_config,
            max_num_kv_tokens=min(client.ready.max_num_kv_tokens for client in clients),
            lora_config=args.lora_config,
        )
        self.output_processor = OutputProcessor(tokenizer)
        hasher = BlockHasher(ready.block_size, ready.prefix_caching_hash_algo)
        self.router = DataParallelRouter(len(clients), hasher)
        self.engine_stats = [SchedulerStats() for _ in clients]  # the latest each reported
        self.engine_errors: list[EngineDeadError | None] = [None] * len(clients)
        self.dead_error: EngineDeadError | None = None
        self._dead = asyncio.Event()
        self._queues: dict[str, RequestOutputCollector] = {}
        self.admission = AdmissionControl(args.max_num_waiting_requests, args.request_timeout)
        self._idle = asyncio.Event()
        self._idle.set()
        self._shut_down = False
        self.recovery = EngineRecovery(self, args.max_engine_restarts, spans_engines(args))
        for index in range(len(clients)):
            metrics.record_engine_alive(index, True)
        self.output_tasks = [
            asyncio.ensure_future(self.run_output_handler(index)) for index in range(len(clients))
        ]

    @classmethod
    async def start(
        cls,
        args: EngineArgs,
        *,
        clients: list[AsyncMPClient] | None = None,
        startup_timeout: float = 600.0,
    ) -> AsyncLLM:
        """Spawn the engine core processes (or take those ``launch_engines`` started) and, while
        they load the model, load the tokenizer here; return once every engine's handshake
        arrives. On failure or cancellation every engine is stopped."""
        dead_codes: dict[int, int] = {}
        engine: AsyncLLM | None = None

        def on_engine_dead(index: int, code: int) -> None:
            if engine is None:
                dead_codes.setdefault(index, code)
            else:
                engine.on_engine_exit(index, code)

        if clients is None:
            clients = launch_engines(args)
        starting = [
            asyncio.ensure_future(
                client.wait_ready(functools.partial(on_engine_dead, index), startup_timeout)
            )
            for index, client in enumerate(clients)
        ]
        try:
            model_config, tokenizer = await asyncio.to_thread(_load_front_end, args)
            await asyncio.gather(*starting)
        except BaseException:
            for task in starting:
                task.cancel()  # stops an engine process still starting
            await asyncio.gather(*starting, return_exceptions=True)
            for client in clients:  # and those that started, or whose wait never began
                with contextlib.suppress(Exception):
                    await client.shutdown(timeout=0.0)
            raise
        engine = cls(args, model_config, tokenizer, clients, EngineMetrics(args.model_name))
        for index, code in dead_codes.items():
            engine.on_engine_exit(index, code)
        return engine

    def on_engine_exit(self, index: int, code: int) -> None:
        """Engine core ``index``'s process exited (its client's watcher calls this)."""
        self._on_engine_dead(index, f"engine core process exited with code {code}")

    @property
    def served_model_name(self) -> str:
        return self.model_config.served_model_name

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def engine_core_pid(self) -> int | None:
        """The first engine core's process id (the only one without data parallelism)."""
        return self.clients[0].pid

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The latest stats of the engine cores, summed (usage averaged) over the live ones."""
        live = [s for s, e in zip(self.engine_stats, self.engine_errors, strict=True) if e is None]
        return _sum_stats(live)

    def engine_states(self) -> list[dict]:
        """Per engine core: its index, process id, whether it is alive, and why not."""
        return [
            {
                "index": index,
                "pid": client.pid,
                "alive": self.engine_errors[index] is None and client.is_alive(),
                "error": None
                if self.engine_errors[index] is None
                else str(self.engine_errors[index]),
            }
            for index, client in enumerate(self.clients)
        ]

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._queues)

    async def wait_until_dead(self) -> None:
        """Return once the engine has failed (or was shut down)."""
        await self._dead.wait()

    async def wait_until_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()

    def fail_requests(self, error: EngineDeadError) -> None:
        """Fail every request in flight with ``error`` and refuse new ones with it."""
        if self.dead_error is None:
            self.dead_error = error
            self._dead.set()
        for queue in self._queues.values():
            queue.put(error)

    def fail_request(self, request_id: str, error: Exception) -> None:
        """End one request with ``error`` (its engine holds nothing of it)."""
        self.output_processor.abort_requests([request_id])
        self.router.finish(request_id)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put(error)

    def give_up(self, error: EngineDeadError) -> None:
        """No engine core is alive and none will be: fail everything (``ember serve`` exits)."""
        self.fail_requests(error)
        self.metrics.clear_engine_gauges()  # nothing runs or waits, no KV is held any more

    def is_healthy(self) -> bool:
        """True while some engine core is alive and serving."""
        return self.dead_error is None and any(state["alive"] for state in self.engine_states())

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` unless an engine core is alive."""
        if not self.is_healthy():
            raise self.dead_error or EngineDeadError("engine core process is not running")

    def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        priority: int = 0,
        stream: bool = True,
        output_kind: RequestOutputKind | None = None,
        timeout: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: deltas when ``stream``, else one final cumulative output
        (``output_kind``, when given, chooses instead: ``CUMULATIVE`` streams everything so far).
        A caller that falls behind gets the engine steps it missed in one output.

        Input is checked here, at the call (``ValueError`` naming the problem), before anything
        reaches the engine core (a ``TokenizedPrompt`` from ``input_processor``, as the HTTP
        routes pass, was checked when it was made); the request is sent when iteration starts.
        Leaving the iteration early (or cancelling it) aborts the request and frees its KV blocks.
        With the waiting queue full (``max_num_waiting_requests``) it raises
        ``EngineOverloadedError``; past ``timeout`` seconds (default ``request_timeout``) the
        request is aborted and the iteration raises ``RequestTimeoutError``.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        prompt = self.input_processor.tokenize(prompt)
        engine_requests = self.input_processor.make_requests(
            request_id, prompt.token_ids, sampling_params, priority, lora_request=lora_request
        )
        deadline = self.admission.deadline(timeout)
        self.admission.check()
        kind = output_kind
        if kind is None:
            kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return self._stream_outputs(
            request_id, prompt.text, sampling_params, engine_requests, kind, deadline
        )

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str,
        priority: int = 0,
    ) -> PoolingRequestOutput:
        """Pool one prompt (embed or classify) and return its result.

        Bad input raises ``ValueError`` before anything reaches the engine core; cancelling the
        call aborts the request and frees its KV blocks.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        ids = self.input_processor.tokenize(prompt).token_ids
        request = self.input_processor.make_pooling_request(
            request_id, ids, pooling_params, priority
        )
        self.admission.check()
        self.output_processor.add_pooling_request(request)
        queue = RequestOutputCollector(RequestOutputKind.FINAL_ONLY)
        self._queues[request_id] = queue
        finished = False
        try:
            await self._send(request_id, [request])
            try:
                item = await queue.get()
            except Exception:
                finished = True  # the engine's answer was an error: nothing left to abort
                raise
            finished = True
            return item
        finally:
            if not finished:
                await self._abort(request_id)
            self.admission.forget(request_id)
            self._forget_queue(request_id, queue)
            self.router.finish(request_id)

    async def _send(self, request_id: str, engine_requests: list[EngineCoreRequest]) -> None:
        """Route one front-end request (all its ``n`` children together) and send it; while
        every engine core is restarting, wait for one."""
        await self.recovery.wait_for_engine()
        decision = self.route(request_id, engine_requests)
        self.metrics.record_route(decision.engine, decision.reason)
        await self.clients[decision.engine].add_requests(engine_requests)
        self.admission.sent(request_id)

    def route(self, request_id: str, engine_requests: list[EngineCoreRequest]) -> RouteDecision:
        """Choose the engine core for a request's sequences (by their prompt's cached prefix)."""
        first = engine_requests[0]
        extras = None
        if first.cache_salt is not None or first.lora_name is not None:
            extras = BlockHashExtras(lora_name=first.lora_name, cache_salt=first.cache_salt)
        return self.router.route(
            request_id, first.prompt_token_ids, extras, load=len(engine_requests)
        )

    async def _stream_outputs(
        self, request_id, text, sampling_params, engine_requests, kind, deadline
    ) -> AsyncIterator[RequestOutput]:
        # Registered on first iteration, so a generator that is never iterated leaves nothing.
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self.output_processor.add_request(request_id, text, sampling_params, engine_requests, kind)
        queue = RequestOutputCollector(kind)
        self._queues[request_id] = queue
        self._idle.clear()
        finished = False
        try:
            await self._send(request_id, engine_requests)
            while not finished:
                item = queue.get_nowait() or await next_before(deadline, queue, request_id)
                self.admission.started(request_id)
                finished = item.finished
                yield item
        except EngineDeadError:
            finished = True
            raise
        finally:
            if not finished:
                await self._abort(request_id)
            self.admission.forget(request_id)
            self._forget_queue(request_id, queue)
            self.router.finish(request_id)
            if not self._queues:
                self._idle.set()

    def _forget_queue(self, request_id: str, queue: RequestOutputCollector) -> None:
        """Drop ``queue`` from the map unless the id already belongs to a newer request."""
        if self._queues.get(request_id) is queue:
            del self._queues[request_id]

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` ends with a final output whose reason is "abort",
        its ``encode`` raises ValueError (a pooling request has no partial result)."""
        await self._abort(request_id, deliver_final=True)

    async def _abort(self, request_id: str, deliver_final: bool = False) -> None:
        engine_ids, finals = self.output_processor.abort_requests([request_id])
        self.metrics.record_iteration(IterationStats(finished_reasons=["abort"] * len(engine_ids)))
        if deliver_final:
            queue = self._queues.get(request_id)
            if queue is not None:
                for final in finals:
                    queue.put(final)
                if engine_ids and not finals:  # a pooling request
                    queue.put(ValueError(f"request {request_id!r} was aborted"))
        engine = self.router.engine_of(request_id)
        if engine_ids and engine is not None and self.engine_errors[engine] is None:
            with contextlib.suppress(EngineDeadError):
                await self.clients[engine].abort_requests(engine_ids)

    async def run_output_handler(self, index: int) -> None:
        try:
            await self._handle_outputs(index)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a front-end bug must not leave requests waiting forever
            self._on_engine_dead(index, f"output handler failed: {exc!r}")
            raise

    async def _handle_outputs(self, index: int) -> None:
        client = self.clients[index]
        processor = self.output_processor
        while True:
            outputs = await client.get_output()
            if outputs.error is not None:
                self._on_engine_dead(index, f"engine core failed:\n{outputs.error}")
                return
            if outputs.kv_events:
                self.router.apply_events(index, outputs.kv_events)
            stats = IterationStats()
            processed = processor.process_outputs(outputs.outputs, stats)
            # A request's last item takes its queue out of the map: the consumer holds the queue
            # still, and one that stops reading without closing (a dropped stream the server has
            # not closed yet) leaves nothing behind.
            for output in processed.request_outputs:
                queue = (self._queues.pop if output.finished else self._queues.get)(
                    output.request_id, None
                )
                if output.finished:  # its engine holds nothing of it any more
                    self.router.finish(output.request_id)
                if queue is not None:
                    queue.put(output)
            for request_id, reason in processed.request_errors.items():
                self.router.finish(request_id)
                queue = self._queues.pop(request_id, None)
                if queue is not None:
                    queue.put(ValueError(f"the engine refused request {request_id!r}: {reason}"))
            if processed.reqs_to_abort:
                with contextlib.suppress(EngineDeadError):
                    await client.abort_requests(processed.reqs_to_abort)
            if outputs.scheduler_stats is not None:
                self.engine_stats[index] = outputs.scheduler_stats
                self.metrics.record_scheduler_stats(outputs.scheduler_stats, self.scheduler_stats)
            self.metrics.record_iteration(stats)

    def _on_engine_dead(self, index: int, reason: str) -> None:
        self.recovery.engine_died(index, reason)

    async def shutdown(self) -> None:
        """Stop the engine core processes and fail whatever is still in flight."""
        for task in self.output_tasks:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._shut_down:
            return
        self._shut_down = True
        await asyncio.gather(*(client.shutdown() for client in self.clients))
        self.fail_requests(EngineDeadError("engine was shut down"))


def _sum_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    if len(stats) == 1:
        return stats[0]
    total = SchedulerStats()
    for item in stats:
        total.num_running_reqs += item.num_running_reqs
        total.num_waiting_reqs += item.num_waiting_reqs
        total.num_unfinished_reqs += item.num_unfinished_reqs
        total.kv_cache_usage += item.kv_cache_usage / len(stats)
    return total


def _load_front_end(args: EngineArgs) -> tuple[ModelConfig, object]:
    model_config = ModelConfig.from_engine_args(args)
    return model_config, load_tokenizer(model_config.tokenizer)
