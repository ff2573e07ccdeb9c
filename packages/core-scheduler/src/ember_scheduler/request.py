"""One request's state inside the scheduler, and its status state machine."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from concurrent.futures import Future

from ember_kv_cache import BlockHashExtras
from ember_scheduler.engine_types import EngineCoreRequest, FinishReason
from ember_scheduler.lora import LoRARequest
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Where a request stands; every status from ``FINISHED_STOPPED`` on is final."""

    WAITING = 0
    WAITING_FOR_FSM = 1  # its structured-output grammar is compiling; not in the waiting queue
    RUNNING = 2
    PREEMPTED = 3
    WAITING_FOR_REMOTE_KVS = 4  # holds blocks while a KV connector loads its prefix into them
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_IGNORED = 8

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.IGNORED,
}

# Which status may follow which; anything else is a scheduler bug and raises.
_TRANSITIONS = {
    RequestStatus.WAITING_FOR_FSM: {RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.WAITING: {
        RequestStatus.WAITING_FOR_FSM,
        RequestStatus.RUNNING,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_IGNORED,
    },
    RequestStatus.WAITING_FOR_REMOTE_KVS: {RequestStatus.WAITING, RequestStatus.FINISHED_ABORTED},
    RequestStatus.RUNNING: {
        RequestStatus.PREEMPTED,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
    },
    RequestStatus.PREEMPTED: {
        RequestStatus.RUNNING,
        # async scheduling: the token of a step in flight when it was preempted ends it
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.FINISHED_ABORTED,
    },
}


class Request:
    """A request as the scheduler tracks it: tokens, progress, status and finish details.

    ``all_token_ids`` is the prompt followed by the outputs so far; the KV cache manager reads it
    (and hashes its full blocks) without copying. ``num_computed_tokens`` counts the tokens whose
    KV is in the cache or scheduled to be; ``spec_token_ids`` holds draft tokens to verify next.
    ``grammar`` is the future of its compiled structured-output grammar, while it waits for it.
    Under async scheduling ``num_output_placeholders`` counts the tokens sampled by steps still
    in flight: the worker already feeds them to the next step, the scheduler learns them later.
    A request with ``pooling_params`` finishes once its prompt is computed, with the pooled
    hidden states instead of tokens.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hash_extras",
        "cache_salt",
        "eos_token_id",
        "finish_detail",
        "grammar",
        "lora_name",
        "lora_request",
        "max_tokens",
        "min_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_logprob_rows_seen",
        "num_prompt_logprob_rows_sent",
        "num_prompt_tokens",
        "output_token_ids",
        "pooling_params",
        "priority",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_reason",
        "stop_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"Request.request_id must be a non-empty string, got {request_id!r}")
        if len(prompt_token_ids) == 0:
            raise ValueError(f"Request.prompt_token_ids must not be empty (request {request_id!r})")
        if min(prompt_token_ids) < 0:
            raise ValueError(
                f"Request.prompt_token_ids must be non-negative token ids (request {request_id!r})"
            )
        if eos_token_id is not None and eos_token_id < 0:
            raise ValueError(
                f"Request.eos_token_id must be a non-negative token id or None, got "
                f"{eos_token_id} (request {request_id!r})"
            )
        if sampling_params.n != 1:
            raise ValueError(
                f"SamplingParams.n must be 1 inside the engine core (the front end fans out "
                f"n > 1 into separate requests), got {sampling_params.n} for {request_id!r}"
            )
        if output_token_ids and (pooling_params is not None or min(output_token_ids) < 0):
            raise ValueError(
                f"Request.output_token_ids must be non-negative token ids of a generating "
                f"request (request {request_id!r})"
            )
        max_tokens = sampling_params.max_tokens
        if max_tokens is not None and len(output_token_ids) >= max_tokens:
            raise ValueError(
                f"Request.output_token_ids of {request_id!r} hold {len(output_token_ids)} tokens, "
                f"no fewer than SamplingParams.max_tokens ({max_tokens}): nothing is left to do"
            )
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Non-empty for a continuation: the tokens it had produced before it moved here.
        self.output_token_ids: list[int] = list(output_token_ids)
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.spec_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params  # set: finishes after its prompt, pooled
        self.eos_token_id = None if sampling_params.ignore_eos else eos_token_id
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.min_tokens = sampling_params.min_tokens
        # None means "until the context is full"; the scheduler also caps by max_model_len.
        self.max_tokens = (
            sampling_params.max_tokens if sampling_params.max_tokens is not None else 1 << 62
        )
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        lora_name = None if lora_request is None else lora_request.lora_name
        self.lora_name = lora_name
        # What besides token ids keys this request's prefix-cache blocks (None: tokens alone).
        self.block_hash_extras = (
            None
            if cache_salt is None and lora_name is None
            else BlockHashExtras(lora_name=lora_name, cache_salt=cache_salt)
        )
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens, set when first scheduled
        self.num_preemptions = 0
        self.num_prompt_logprob_rows_sent = 0
        self.num_prompt_logprob_rows_seen = 0
        self.stop_reason: int | str | None = None
        self.finish_detail: str | None = None
        self.grammar: Future | None = None

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> Request:
        return cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time or None,
            priority=request.priority,
            cache_salt=request.cache_salt,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
            output_token_ids=request.output_token_ids,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def set_status(self, status: RequestStatus) -> None:
        """Move to ``status``; raises RuntimeError on a transition the state machine forbids."""
        if status not in _TRANSITIONS.get(self.status, ()):
            raise RuntimeError(
                f"request {self.request_id!r} cannot go from {self.status.name} to {status.name}"
            )
        self.status = status

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, outputs={len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens})"
        )
