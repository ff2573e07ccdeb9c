"""Scheduler limits and policies, and the checks and defaults every side's settings share."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from ember_kv_cache import DEFAULT_HASH_ALGO, HASH_ALGOS

if TYPE_CHECKING:
    from ember_scheduler.lora import LoRAConfig

SCHEDULING_POLICIES = ("fcfs", "priority")
# Defaults of the limits that the scheduler, the worker and the engine arguments all read.
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_BLOCK_SIZE = 16


def check_int(name: str, value, *, minimum: int = 1, optional: bool = False) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int of at least ``minimum`` (or
    None, when ``optional``); bools are refused. Every settings object checks its counts here."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {wanted}, got {value!r}")


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

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO
    enable_kv_events: bool = False  # the engine core reports prefix-cache changes in its outputs
    num_lookahead_tokens: int = 0
    num_speculative_tokens: int = 0
    async_scheduling: bool = False
    # Set: requests may run with LoRA adapters, at most lora.max_loras distinct ones per step.
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            check_int(f"SchedulerConfig.{name}", getattr(self, name))
        for name in (
            "long_prefill_token_threshold",
            "num_lookahead_tokens",
            "num_speculative_tokens",
        ):
            check_int(f"SchedulerConfig.{name}", getattr(self, name), minimum=0)
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"SchedulerConfig.policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}"
            )
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"SchedulerConfig.prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "SchedulerConfig.max_num_batched_tokens must be at least max_model_len "
                f"({self.max_model_len}) when chunked prefill is disabled, got "
                f"{self.max_num_batched_tokens}"
            )
