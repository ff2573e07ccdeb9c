"""Turning the engine core's per-step token diffs into ``RequestOutput``s.

Per sequence it detokenizes incrementally, applies stop strings (a sequence ended by one is
reported for abort in the engine core), converts logprobs, and times the request for metrics.
The ``n`` sequences of one request are gathered under their parent's id.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import msgspec
import numpy as np

from ember_scheduler.engine_types import EngineCoreOutput, EngineCoreRequest, FinishReason
from ember_scheduler.outputs import Logprobs
from ember_scheduler.sampling_params import SamplingParams
from ember_server.engine.detokenizer import IncrementalDetokenizer
from ember_server.engine.logprobs import LogprobsDecoder
from ember_server.engine.metrics import IterationStats
from ember_server.engine.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestOutput,
    RequestOutputKind,
    SampleLogprobs,
)
from ember_server.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput


class ParentRequest:
    """The front end's view of one request and its ``n`` sequences."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: RequestOutputKind,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.output_kind = output_kind
        self.latest: list[CompletionOutput | None] = [None] * params.n
        self.num_unfinished = params.n
        self.num_cached_tokens = 0
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self.num_migrations = 0  # times it moved to another engine core (``continuations``)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def make_output(self, child: CompletionOutput) -> RequestOutput | None:
        """Record a sequence's output; return what the caller should see now, if anything."""
        if child.finish_reason is not None:
            self.num_unfinished -= 1
        kind = self.output_kind
        if kind == RequestOutputKind.DELTA:
            outputs = [child]
            prompt_logprobs = None if self.prompt_logprobs_sent else self.prompt_logprobs
            self.prompt_logprobs_sent = prompt_logprobs is not None
        else:
            self.latest[child.index] = child
            if kind == RequestOutputKind.FINAL_ONLY and not self.finished:
                return None
            outputs = [o for o in self.latest if o is not None]
            prompt_logprobs = self.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
        )


class RequestState:
    """One sequence in flight: its detokenizer, logprobs so far and timing."""

    def __init__(
        self,
        parent: ParentRequest,
        index: int,
        request: EngineCoreRequest,
        detokenizer: IncrementalDetokenizer,
        wants_logprobs: bool,
        wants_prompt_logprobs: bool,
        arrival_time: float,
    ) -> None:
        self.parent = parent
        self.index = index
        self.request = request  # as first sent, for a continuation elsewhere
        self.detokenizer = detokenizer
        self.logprobs: SampleLogprobs | None = [] if wants_logprobs else None
        self.cumulative_logprob: float | None = 0.0 if wants_logprobs else None
        self.prompt_logprob_rows: Logprobs | None = (
            Logprobs([], [], []) if wants_prompt_logprobs else None
        )
        self.arrival_time = arrival_time  # time.monotonic()
        self.last_token_time: float | None = None


@dataclasses.dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput | PoolingRequestOutput]
    reqs_to_abort: list[str]  # engine request ids ended by a stop string, or by a refused sibling
    # Requests the engine core refused (IGNORED, or ABORT when it could not admit one), by
    # request id: each fails with the reason, and its other sequences are aborted.
    request_errors: dict[str, str] = dataclasses.field(default_factory=dict)


class OutputProcessor:
    """Holds the front-end state of every request in flight (keyed by engine request id)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.logprobs_decoder = LogprobsDecoder(tokenizer)
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._children: dict[str, list[str]] = {}
        # Pooling requests in flight (one engine request each, same id).
        self.pooling_requests: dict[str, EngineCoreRequest] = {}

    def add_pooling_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.parent_requests or request.request_id in (
            self.pooling_requests
        ):
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        self.pooling_requests[request.request_id] = request

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        engine_requests: list[EngineCoreRequest],
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
    ) -> None:
        if request_id in self.parent_requests:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        prompt_token_ids = engine_requests[0].prompt_token_ids
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params, output_kind)
        now = time.monotonic()
        for index, request in enumerate(engine_requests):
            self.request_states[request.request_id] = RequestState(
                parent,
                index,
                request,
                IncrementalDetokenizer(self.tokenizer, prompt_token_ids, request.sampling_params),
                wants_logprobs=params.logprobs is not None,
                wants_prompt_logprobs=request.sampling_params.prompt_logprobs is not None,
                arrival_time=now,
            )
        self.parent_requests[request_id] = parent
        self._children[request_id] = [r.request_id for r in engine_requests]

    def has_unfinished_requests(self) -> bool:
        return bool(self.parent_requests) or bool(self.pooling_requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.parent_requests) + len(self.pooling_requests)

    def abort_requests(self, request_ids: Iterable[str]) -> tuple[list[str], list[RequestOutput]]:
        """Forget requests; return their unfinished engine ids and the outputs reporting the
        aborts (the last of a request is finished; DELTA gives one per aborted sequence)."""
        engine_ids: list[str] = []
        finals: list[RequestOutput] = []
        for request_id in request_ids:
            if self.pooling_requests.pop(request_id, None) is not None:
                engine_ids.append(request_id)
                continue
            parent = self.parent_requests.pop(request_id, None)
            for child_id in self._children.pop(request_id, []):
                state = self.request_states.pop(child_id, None)
                if state is None:
                    continue
                engine_ids.append(child_id)
                output = self._completion_output(state, [], None, FinishReason.ABORT, None)
                request_output = parent.make_output(output)
                if request_output is not None:
                    finals.append(request_output)
        return engine_ids, finals

    def continuations(self, request_id: str) -> list[EngineCoreRequest]:
        """What to send another engine core for request ``request_id`` whose engine died: each
        unfinished sequence as first sent, with the tokens already delivered as its
        ``output_token_ids`` (so the client sees one stream, nothing repeated or missing).
        Prompt logprobs already delivered are not asked for again; partial ones start over."""
        pooling = self.pooling_requests.get(request_id)
        if pooling is not None:
            return [pooling]
        parent = self.parent_requests.get(request_id)
        if parent is None:
            return []
        parent.num_migrations += 1
        requests = []
        for child_id in self._children[request_id]:
            state = self.request_states.get(child_id)
            if state is None:
                continue
            request = state.request
            produced = list(state.detokenizer.token_ids)
            params = request.sampling_params
            if parent.prompt_logprobs is not None:
                params = msgspec.structs.replace(params, prompt_logprobs=None)
            elif state.prompt_logprob_rows is not None:
                state.prompt_logprob_rows = Logprobs([], [], [])
            requests.append(
                msgspec.structs.replace(request, sampling_params=params, output_token_ids=produced)
            )
        return requests

    def process_outputs(
        self, outputs: list[EngineCoreOutput], iteration_stats: IterationStats | None = None
    ) -> OutputProcessorOutput:
        now = time.monotonic()
        request_outputs: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        request_errors: dict[str, str] = {}
        for out in outputs:
            if out.request_id in self.pooling_requests:
                self._process_pooled(out, request_outputs, request_errors)
                continue
            state = self.request_states.get(out.request_id)
            if state is None:  # aborted by the front end meanwhile
                continue
            parent = state.parent
            if out.finish_detail is not None:  # refused by the engine core
                engine_ids, _ = self.abort_requests([parent.request_id])
                reqs_to_abort.extend(i for i in engine_ids if i != out.request_id)
                request_errors[parent.request_id] = out.finish_detail
                continue
            new_ids = out.new_token_ids
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if parent.num_migrations == 0:  # a continuation's cache hits count its outputs
                parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.new_prompt_logprobs is not None and state.prompt_logprob_rows is not None:
                state.prompt_logprob_rows.extend(out.new_prompt_logprobs)
            stop_string = state.detokenizer.update(
                new_ids, stop_terminated=finish_reason == FinishReason.STOP
            )
            if stop_string is not None:
                if finish_reason is None:
                    reqs_to_abort.append(out.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            if not new_ids and finish_reason is None:
                continue  # a prefill chunk: nothing to report yet
            if state.prompt_logprob_rows is not None and parent.prompt_logprobs is None:
                parent.prompt_logprobs = self.logprobs_decoder.prompt_logprobs(
                    state.prompt_logprob_rows
                )
            new_logprobs = None
            if out.new_logprobs is not None and state.logprobs is not None:
                new_logprobs, total = self.logprobs_decoder.sample_logprobs(out.new_logprobs)
                state.logprobs.extend(new_logprobs)
                state.cumulative_logprob += total
            if iteration_stats is not None:
                self._record(state, len(new_ids), finish_reason, now, iteration_stats)
            finished = finish_reason is not None
            if finished:
                del self.request_states[out.request_id]
            elif parent.output_kind == RequestOutputKind.FINAL_ONLY:
                continue  # nothing to assemble until the end
            completion = self._completion_output(
                state, new_ids, new_logprobs, finish_reason, stop_reason
            )
            request_output = parent.make_output(completion)
            if parent.finished:
                del self.parent_requests[parent.request_id]
                del self._children[parent.request_id]
            if request_output is not None:
                request_outputs.append(request_output)
        return OutputProcessorOutput(request_outputs, reqs_to_abort, request_errors)

    def _process_pooled(
        self,
        out: EngineCoreOutput,
        request_outputs: list[RequestOutput | PoolingRequestOutput],
        request_errors: dict[str, str],
    ) -> None:
        if out.finish_reason is None:
            return
        prompt_token_ids = self.pooling_requests.pop(out.request_id).prompt_token_ids
        if out.pooling_output is None:  # refused or aborted by the engine core
            request_errors[out.request_id] = out.finish_detail or str(out.finish_reason)
            return
        data = np.frombuffer(out.pooling_output, dtype="<f4").astype(np.float32)
        request_outputs.append(
            PoolingRequestOutput(
                out.request_id,
                PoolingOutput(data),
                prompt_token_ids,
                num_cached_tokens=out.num_cached_tokens,
            )
        )

    def _completion_output(
        self,
        state: RequestState,
        new_ids: list[int],
        new_logprobs: SampleLogprobs | None,
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput:
        finished = finish_reason is not None
        delta = state.parent.output_kind == RequestOutputKind.DELTA
        detokenizer = state.detokenizer
        if delta:
            token_ids = list(new_ids)
            logprobs = (new_logprobs or []) if state.logprobs is not None else None
        else:
            token_ids = list(detokenizer.token_ids)
            logprobs = list(state.logprobs) if state.logprobs is not None else None
        return CompletionOutput(
            index=state.index,
            text=detokenizer.get_next_output_text(finished, delta),
            token_ids=token_ids,
            cumulative_logprob=state.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=None if finish_reason is None else str(finish_reason),
            stop_reason=stop_reason,
        )

    @staticmethod
    def _record(
        state: RequestState,
        num_new_tokens: int,
        finish_reason: FinishReason | None,
        now: float,
        stats: IterationStats,
    ) -> None:
        if num_new_tokens:
            stats.num_generation_tokens += num_new_tokens
            if state.last_token_time is None:
                stats.time_to_first_tokens.append(now - state.arrival_time)
                if state.index == 0:
                    stats.num_prompt_tokens += len(state.parent.prompt_token_ids)
            else:
                stats.inter_token_latencies.append(now - state.last_token_time)
            state.last_token_time = now
        if finish_reason is not None:
            stats.e2e_latencies.append(now - state.arrival_time)
            stats.finished_reasons.append(str(finish_reason))
