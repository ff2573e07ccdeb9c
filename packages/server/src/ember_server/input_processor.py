"""Front-end input checks and tokenization: a prompt becomes one ``EngineCoreRequest`` per sequence.

Every check runs before anything reaches the engine core, so bad input raises ``ValueError`` and
leaves no state behind. A request with ``n`` > 1 becomes ``n`` child requests with the same prompt
(ids ``"{index}_{request_id}"``): the first to be scheduled fills the prefix cache and the others
reuse its KV blocks instead of recomputing the prompt.
"""

from __future__ import annotations

import functools
import operator
import time
import typing
from collections.abc import Sequence

import msgspec
import numpy as np

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.sampling_params import SamplingParams
from ember_server.model_config import ModelConfig

PromptType = str | Sequence[int]

# Integers travel to the engine core as msgpack int64, and its tensors hold them as int64.
_Int64 = typing.Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def _with_int64(field_type):
    """``field_type`` with every ``int`` in it bounded to int64."""
    if field_type is int:
        return _Int64
    args = typing.get_args(field_type)
    if typing.get_origin(field_type) is list:
        return list[_with_int64(args[0])]
    if args:
        return functools.reduce(operator.or_, map(_with_int64, args))
    return field_type


# SamplingParams does not check types on construction; the engine core's msgpack decoder does,
# and a request it cannot decode (or an int beyond 64 bits) would end the engine core process.
_SAMPLING_PARAMS_FIELDS = [
    (f.name, _with_int64(f.type)) for f in msgspec.structs.fields(SamplingParams)
]


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    """Validates and tokenizes prompts and builds the engine core's requests."""

    def __init__(
        self, tokenizer, model_config: ModelConfig, max_num_kv_tokens: int | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.max_num_kv_tokens = max_num_kv_tokens  # the longest sequence the KV cache holds

    def tokenize(
        self, prompt: PromptType, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """``(prompt text or None, prompt token ids)``; token ids are checked against the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
            return prompt, list(ids)
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        ids = np.asarray(prompt)
        if ids.size == 0:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.model_config.vocab_size
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"prompt_token_ids must be a flat list of integers in [0, {vocab})")
        return None, ids.tolist()

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> list[EngineCoreRequest]:
        """The engine core requests for one prompt: one, or ``n`` children sharing the prompt."""
        self._check(request_id, prompt_token_ids, params, priority)
        config = self.model_config
        engine_params = params.clone(n=1)
        if config.extra_eos_token_ids and not params.ignore_eos:
            extra = [t for t in config.extra_eos_token_ids if t not in params.stop_token_ids]
            engine_params = engine_params.clone(stop_token_ids=[*params.stop_token_ids, *extra])
        arrival = time.time() if arrival_time is None else arrival_time
        requests = []
        for index in range(params.n):
            child_params = engine_params
            if index > 0:
                # Each child samples differently; only the first computes prompt logprobs (a
                # request asking for them cannot use the prefix cache).
                seed = None if params.seed is None else params.seed + index
                child_params = engine_params.clone(seed=seed, prompt_logprobs=None)
            requests.append(
                EngineCoreRequest(
                    request_id=child_request_id(request_id, index, params.n),
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=child_params,
                    eos_token_id=config.eos_token_id,
                    arrival_time=arrival,
                    priority=priority,
                )
            )
        return requests

    def _check(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        for name, field_type in _SAMPLING_PARAMS_FIELDS:
            try:
                msgspec.convert(getattr(params, name), field_type)
            except msgspec.ValidationError as exc:
                raise ValueError(f"SamplingParams.{name}: {exc}") from None
        try:
            msgspec.convert(priority, _Int64)
        except msgspec.ValidationError as exc:
            raise ValueError(f"priority: {exc}") from None
        if priority != 0 and self.model_config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduling policy "
                "(EngineArgs.scheduling_policy='priority', --scheduling-policy priority)"
            )
        max_model_len = self.model_config.max_model_len
        num_prompt = len(prompt_token_ids)
        if num_prompt >= max_model_len:
            raise ValueError(
                f"prompt is {num_prompt} tokens, which leaves no room for output in this model's "
                f"maximum context length of {max_model_len} tokens"
            )
        if self.max_num_kv_tokens is not None and num_prompt >= self.max_num_kv_tokens:
            raise ValueError(
                f"prompt is {num_prompt} tokens, which leaves no room for output in the KV cache "
                f"({self.max_num_kv_tokens} tokens in all); raise kv_cache_memory"
            )
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be below the vocab size {vocab}")
