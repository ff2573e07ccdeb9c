"""What the scheduler hands the executor each step, and what the executor hands back.

``SchedulerOutput`` is a diff, as in vLLM v1: a request is sent in full once (``NewRequestData``),
then only as changes (``CachedRequestData``). The worker keeps each request's state (its tokens,
including the tokens it sampled itself) in a persistent batch. A request preempted by recompute is
dropped by the worker (``preempted_req_ids``) and, when resumed, sent again as a new request with
its output tokens so far.
"""

from __future__ import annotations

import msgspec

from ember_kv_cache import KVConnectorMetadata, KVConnectorOutput
from ember_scheduler.lora import LoRARequest
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import SamplingParams

# A draft token the scheduler schedules before it knows it (async scheduling): the worker, which
# proposed the drafts, feeds its own in its place.
DRAFT_PLACEHOLDER = -1


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs of a run of tokens, one row per token.

    Row ``i``: ``token_ids[i][0]`` is the token actually chosen (sampled, or the prompt's next
    token), followed by the top-N alternatives in descending order; ``logprobs[i]`` aligns with it;
    ``ranks[i]`` is the chosen token's rank (1 = most likely) in the full distribution.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def extend(self, other: Logprobs) -> None:
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has not seen (or has dropped after preemption), in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hits)
    # The EOS id the request stops at (None: none, or ignore_eos); the sampler masks it, and the
    # request's stop_token_ids, until the request has min_tokens outputs.
    eos_token_id: int | None = None
    pooling_params: PoolingParams | None = None  # a pooling request: pool, never sample
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model


class CachedRequestData(msgspec.Struct, array_like=True):
    """Running requests the worker already holds, as parallel columns of changes."""

    req_ids: list[str] = msgspec.field(default_factory=list)
    new_block_ids: list[list[int]] = msgspec.field(default_factory=list)  # appended this step
    num_computed_tokens: list[int] = msgspec.field(default_factory=list)
    # Drafts of the request's step in flight that num_computed_tokens counts as accepted (async
    # scheduling with speculation); the worker, which verified them, takes the rejected ones off.
    # Empty: none for any request.
    num_drafts_in_flight: list[int] = msgspec.field(default_factory=list)


class SchedulerOutput(msgspec.Struct, array_like=True):
    """One step's work: which requests run, how many tokens each, and what changed."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    num_common_prefix_blocks: int = 0
    finished_req_ids: set[str] = msgspec.field(default_factory=set)  # worker drops these
    preempted_req_ids: set[str] = msgspec.field(default_factory=set)  # and these
    kv_connector_metadata: KVConnectorMetadata | None = None  # KV loads and saves to run
    # (source, target) block ids: copy every layer's KV before the forward (partial prefix hits)
    kv_block_copies: list[tuple[int, int]] = msgspec.field(default_factory=list)


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    """Sampled tokens per scheduled request (``[]`` for a request still in prefill).

    With speculative decoding ``sampled_token_ids[i]`` holds the accepted draft tokens plus one
    bonus token, and ``spec_token_ids[i]`` the proposals for the next step.
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: Logprobs | None = None  # one row per sampled token, in req_ids order
    prompt_logprobs: dict[str, Logprobs] = msgspec.field(default_factory=dict)
    spec_token_ids: list[list[int]] | None = None
    kv_connector_output: KVConnectorOutput | None = None  # KV loads that finished
    # Pooling requests whose prompt completed this step: the pooled vector as float32 bytes
    # (little-endian). Their sampled_token_ids rows are empty.
    pooler_output: dict[str, bytes] = msgspec.field(default_factory=dict)
