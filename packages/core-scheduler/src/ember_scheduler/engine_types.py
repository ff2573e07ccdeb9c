"""Messages between a front end and the engine core (msgspec msgpack on the wire; never pickle)."""

from __future__ import annotations

import enum

import msgspec

from ember_kv_cache import KVConnectorStats
from ember_scheduler.lora import LoRARequest
from ember_scheduler.outputs import Logprobs
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request ended; ``str()`` gives the OpenAI API's word."""

    STOP = 0  # EOS, a stop token id, or a stop string
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # cancelled by the client or the front end
    IGNORED = 3  # can never be served (prompt longer than max_model_len)

    def __str__(self) -> str:
        return ("stop", "length", "abort", "ignored")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A tokenized request as the front end hands it to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter to run with; None: the base model
    # Set for a pooling request: it returns pooled hidden states after its prompt and samples
    # nothing (its sampling_params are ignored).
    pooling_params: PoolingParams | None = None
    # A continuation (a request moved from an engine core that died): the tokens it had already
    # produced. The engine recomputes their KV and goes on from there, as after a preemption, so
    # seeded sampling, penalties, min_tokens, max_tokens and the grammar see the same history.
    output_token_ids: list[int] = msgspec.field(default_factory=list)

    @property
    def lora_name(self) -> str | None:
        return None if self.lora_request is None else self.lora_request.lora_name


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What changed for one request in one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id (or string, set by the front end)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # Set only when the engine core refused the request (IGNORED; ABORT when it could not admit it
    # or compile its grammar): the reason, which the front end raises as that request's error.
    finish_detail: str | None = None
    pooling_output: bytes | None = None  # a pooling request's result: float32, little-endian

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecodingStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Draft verification counts since the previous stats: ``num_drafts`` requests verified
    ``num_draft_tokens`` drafts, of which ``num_accepted_tokens`` were accepted, and
    ``num_accepted_tokens_per_pos[j]`` at draft position j."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = msgspec.field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted_tokens):
            per_pos[position] += 1


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Gauges and counters since the previous step, for metrics."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_unfinished_reqs: int = 0  # every request the scheduler holds (its request map)
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up this step
    prefix_cache_hits: int = 0  # of those, tokens found
    num_preemptions: int = 0
    kv_connector_stats: KVConnectorStats | None = None  # with a KV connector: lookups and tiers
    spec_decoding: SpecDecodingStats | None = None  # None without speculative decoding
    lora: LoRAStats | None = None  # None without LoRA


class LoRAStats(msgspec.Struct, array_like=True):
    """Which adapters the running and the waiting requests use (names, in first-seen order),
    and the per-step limit: vLLM's ``lora_requests_info``."""

    max_loras: int
    running: list[str]
    waiting: list[str]


class KVBlocksStored(msgspec.Struct, tag="stored", array_like=True):
    """Blocks that entered the engine's prefix cache, by their chained block hashes, in one
    layer group (0 unless the model's layers keep different KV: ``ember_kv_cache`` groups)."""

    block_hashes: list[bytes]
    group: int = 0


class KVBlocksRemoved(msgspec.Struct, tag="removed", array_like=True):
    """Cached blocks the engine evicted, by their chained block hashes, in one layer group."""

    block_hashes: list[bytes]
    group: int = 0


class KVCacheCleared(msgspec.Struct, tag="cleared", array_like=True):
    """The engine dropped its whole prefix cache."""


# What a front end needs of the kv-cache manager's events to mirror an engine's prefix cache.
KVEvent = KVBlocksStored | KVBlocksRemoved | KVCacheCleared


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's outputs for every request that changed.

    ``kv_events`` (only from an engine core built with ``enable_kv_events``) are the prefix-cache
    changes since the previous outputs, oldest first.
    """

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    error: str | None = None  # set when the engine core failed; the front end fails all requests
    kv_events: list[KVEvent] = msgspec.field(default_factory=list)
