"""The asynchronous front end for serving: ``AsyncLLM`` over an engine core process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from ember_scheduler.engine_types import SchedulerStats
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams
from ember_server.core_client import AsyncMPClient, EngineDeadError
from ember_server.engine_args import EngineArgs
from ember_server.input_processor import InputProcessor, PromptType
from ember_server.metrics import EngineMetrics, IterationStats
from ember_server.model_config import ModelConfig
from ember_server.output_processor import OutputProcessor
from ember_server.outputs import RequestOutput, RequestOutputKind
from ember_server.pooling_outputs import PoolingRequestOutput
from ember_server.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class AsyncLLM:
    """Tokenizes, detokenizes and streams in the event loop; the engine core runs in its own process.

    Build it with ``await AsyncLLM.start(args)`` inside the event loop that will use it. If the
    engine process dies, ``errored`` turns true at once, every in-flight ``generate`` raises
    ``EngineDeadError`` and new ones are refused.
    """

    def __init__(
        self,
        args: EngineArgs,
        model_config: ModelConfig,
        tokenizer,
        client: AsyncMPClient,
        metrics: EngineMetrics,
    ) -> None:
        self.engine_args = args
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.client = client
        self.metrics = metrics
        ready = client.ready
        self.input_processor = InputProcessor(
            tokenizer, model_config, max_num_kv_tokens=ready.max_num_kv_tokens
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.scheduler_stats = SchedulerStats()  # the latest the engine core reported
        self.dead_error: EngineDeadError | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._shut_down = False
        self._output_task = asyncio.ensure_future(self._run_output_handler())

    @classmethod
    async def start(cls, args: EngineArgs, *, startup_timeout: float = 600.0) -> AsyncLLM:
        """Spawn the engine core process and, while it loads the model, the tokenizer here;
        return once the engine's handshake arrives."""
        dead_codes: list[int] = []
        engine: AsyncLLM | None = None

        def on_engine_dead(code: int) -> None:
            if engine is None:
                dead_codes.append(code)
            else:
                engine._on_engine_dead(f"engine core process exited with code {code}")

        starting = asyncio.ensure_future(
            AsyncMPClient.start(args, on_engine_dead, startup_timeout=startup_timeout)
        )
        try:
            model_config, tokenizer = await asyncio.to_thread(_load_front_end, args)
        except BaseException:
            starting.cancel()  # stops the engine process
            with contextlib.suppress(BaseException):
                await starting
            raise
        client = await starting
        engine = cls(args, model_config, tokenizer, client, EngineMetrics(args.model_name))
        if dead_codes:
            engine._on_engine_dead(f"engine core process exited with code {dead_codes[0]}")
        return engine

    @property
    def served_model_name(self) -> str:
        return self.model_config.served_model_name

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def engine_core_pid(self) -> int | None:
        return self.client.pid

    def is_healthy(self) -> bool:
        return self.dead_error is None and self.client.is_alive()

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` unless the engine core is alive."""
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
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs: deltas when ``stream``, else one final cumulative output
        (``output_kind``, when given, chooses instead: ``CUMULATIVE`` streams everything so far).

        Input is checked here, at the call (``ValueError`` naming the problem), before anything
        reaches the engine core; the request is sent when iteration starts. Leaving the iteration
        early (or cancelling it) aborts the request and frees its KV blocks.
        """
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        text, ids = self.input_processor.tokenize(prompt)
        engine_requests = self.input_processor.make_requests(
            request_id, ids, sampling_params, priority
        )
        kind = output_kind
        if kind is None:
            kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return self._stream_outputs(request_id, text, sampling_params, engine_requests, kind)

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
        _, ids = self.input_processor.tokenize(prompt)
        request = self.input_processor.make_pooling_request(
            request_id, ids, pooling_params, priority
        )
        self.output_processor.add_pooling_request(request)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self.client.add_requests([request])
            item = await queue.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            if not finished:
                await self._abort(request_id)
            self._queues.pop(request_id, None)

    async def _stream_outputs(
        self, request_id, text, sampling_params, engine_requests, kind
    ) -> AsyncIterator[RequestOutput]:
        # Registered on first iteration, so a generator that is never iterated leaves nothing.
        if self.dead_error is not None:
            raise self.dead_error
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        self.output_processor.add_request(request_id, text, sampling_params, engine_requests, kind)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self.client.add_requests(engine_requests)
            while not finished:
                item = queue.get_nowait() if not queue.empty() else await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        except EngineDeadError:
            finished = True
            raise
        finally:
            if not finished:
                await self._abort(request_id)
            self._queues.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its ``generate`` ends with a final output whose reason is "abort"."""
        await self._abort(request_id, deliver_final=True)

    async def _abort(self, request_id: str, deliver_final: bool = False) -> None:
        engine_ids, finals = self.output_processor.abort_requests([request_id])
        self.metrics.record_iteration(IterationStats(finished_reasons=["abort"] * len(engine_ids)))
        if deliver_final:
            queue = self._queues.get(request_id)
            for final in finals:
                if queue is not None:
                    queue.put_nowait(final)
        if engine_ids and self.dead_error is None:
            with contextlib.suppress(EngineDeadError):
                await self.client.abort_requests(engine_ids)

    async def _run_output_handler(self) -> None:
        try:
            await self._handle_outputs()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a front-end bug must not leave requests waiting forever
            self._on_engine_dead(f"output handler failed: {exc!r}")
            raise

    async def _handle_outputs(self) -> None:
        client = self.client
        processor = self.output_processor
        while True:
            outputs = await client.get_output()
            if outputs.error is not None:
                self._on_engine_dead(f"engine core failed:\n{outputs.error}")
                return
            stats = IterationStats()
            processed = processor.process_outputs(outputs.outputs, stats)
            for output in processed.request_outputs:
                queue = self._queues.get(output.request_id)
                if queue is not None:
                    queue.put_nowait(output)
            for request_id, reason in processed.request_errors.items():
                queue = self._queues.get(request_id)
                if queue is not None:
                    queue.put_nowait(
                        ValueError(f"the engine refused request {request_id!r}: {reason}")
                    )
            if processed.reqs_to_abort:
                with contextlib.suppress(EngineDeadError):
                    await client.abort_requests(processed.reqs_to_abort)
            if outputs.scheduler_stats is not None:
                self.scheduler_stats = outputs.scheduler_stats
                self.metrics.record_scheduler_stats(outputs.scheduler_stats)
            self.metrics.record_iteration(stats)

    def _on_engine_dead(self, reason: str) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = EngineDeadError(reason)
        logger.error("engine is dead, failing %d requests: %s", len(self._queues), reason)
        for queue in self._queues.values():
            queue.put_nowait(self.dead_error)
        if not self._output_task.done():
            self._output_task.cancel()

    async def shutdown(self) -> None:
        """Stop the engine core process and fail whatever is still in flight."""
        if not self._output_task.done():
            self._output_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._output_task
        if self._shut_down:
            return
        self._shut_down = True
        await self.client.shutdown()
        if self.dead_error is None:
            self.dead_error = EngineDeadError("engine was shut down")
            for queue in self._queues.values():
                queue.put_nowait(self.dead_error)


def _load_front_end(args: EngineArgs) -> tuple[ModelConfig, object]:
    model_config = ModelConfig.from_engine_args(args)
    return model_config, load_tokenizer(model_config.tokenizer)
