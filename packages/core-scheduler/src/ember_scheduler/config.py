"""Scheduler limits and policies."""

from __future__ import annotations

import dataclasses
from typing import Literal

_POLICIES = ("fcfs", "priority")
_HASH_ALGOS = ("sha256", "xxhash64", "xxhash128")


@dataclasses.dataclass
class SchedulerConfig:
    """Limits of one scheduling step and the policies the scheduler follows.

    ``max_num_batched_tokens`` is the token budget of a step, shared by prefill chunks and decodes;
    ``long_prefill_token_threshold`` (0 = off) caps how many prompt tokens one request may take in
    a step, so that one long prompt does not starve the others. ``num_lookahead_tokens`` reserves
    KV slots for that many speculative tokens beyond the scheduled ones (for a drafter that
    writes KV). With ``async_scheduling`` step n+1 is scheduled while step n runs: each request
    about to sample holds an output placeholder until its token arrives (the worker feeds the
    token to step n+1 itself). ``num_speculative_tokens`` is how many drafts the worker proposes
    per request and step: with async scheduling the scheduler reserves that many draft slots with
    placeholders, as the drafts of step n are still on the worker when step n+1 is scheduled.
    Validated on construction (ValueError names the field).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    enable_kv_events: bool = False  # the engine core reports prefix-cache changes in its outputs
    num_lookahead_tokens: int = 0
    num_speculative_tokens: int = 0
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive int, got {value!r}")
        for name in (
            "long_prefill_token_threshold",
            "num_lookahead_tokens",
            "num_speculative_tokens",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 0, got {value!r}")
        if self.policy not in _POLICIES:
            raise ValueError(
                f"SchedulerConfig.policy must be one of {_POLICIES}, got {self.policy!r}"
            )
        if self.prefix_caching_hash_algo not in _HASH_ALGOS:
            raise ValueError(
                f"SchedulerConfig.prefix_caching_hash_algo must be one of {_HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "SchedulerConfig.max_num_batched_tokens must be at least max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled, got "
                f"{self.max_num_batched_tokens}"
            )
