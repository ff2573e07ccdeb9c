"""Front-end input checks and tokenization: a prompt becomes one ``EngineCoreRequest`` per sequence.

The one owner of the request rules the offline ``LLM``, ``AsyncLLM`` and the HTTP routes share:
text and chat conversations become token ids through its ``TextEncoder``; token ids lie in the
vocabulary; a prompt has tokens and leaves room for output within the length limit
(``max_num_tokens``); a structured-output spec parses. Every check runs before anything reaches
the engine core, so bad input raises ``ValueError`` naming the field and leaves no state behind
(the engine core keeps its own checks only as a guard for callers that bypass this one). A request with ``n`` > 1 becomes ``n`` child requests with the same prompt
(ids ``"{index}_{request_id}"``): the first to be scheduled fills the prefix cache and the others
reuse its KV blocks instead of recomputing the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ember_scheduler.engine_types import EngineCoreRequest
from ember_scheduler.lora import LoRAConfig, LoRARequest
from ember_scheduler.pooling_params import PoolingParams
from ember_scheduler.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from ember_server.engine.lora_registry import LoRARegistry
from ember_server.engine.model_config import ModelConfig
from ember_server.engine.text_encoding import TextEncoder


class TokenizedPrompt(NamedTuple):
    """A prompt that passed the input processor's checks (made by its ``tokenize*`` methods):
    its text (None when it came as token ids) and its token ids. Passed on as it is, it is not
    checked or tokenized again."""

    text: str | None
    token_ids: list[int]


PromptType = str | Sequence[int] | TokenizedPrompt
# What a pooling request carries for sampling: never used (it samples nothing), and greedy so that
# a row sampled alongside generation requests draws no random numbers.
_POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


def child_seed(seed: int | None, index: int) -> int | None:
    """Child ``index``'s seed: ``seed + index``, wrapped around within int64 so that every valid
    seed gives valid, distinct children."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % (1 << 64) + INT64_MIN


class InputProcessor:
    """Validates and tokenizes prompts and builds the engine core's requests."""

    def __init__(
        self,
        tokenizer,
        model_config: ModelConfig,
        max_num_kv_tokens: int | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.loras = LoRARegistry(model_config.model, lora_config)
        self.model_config = model_config
        self.max_num_kv_tokens = max_num_kv_tokens  # the longest sequence the KV cache holds
        self.text_encoder = TextEncoder(tokenizer, model_config.max_model_len)

    @property
    def max_num_tokens(self) -> int:
        """The longest sequence a request may reach: ``max_model_len``, or the KV cache's
        capacity where that is smaller."""
        if self.max_num_kv_tokens is None:
            return self.model_config.max_model_len
        return min(self.model_config.max_model_len, self.max_num_kv_tokens)

    def output_room(self, num_prompt_tokens: int) -> int:
        """How many tokens a prompt this long leaves for output: the one owner of the sequence
        length limit (``max_model_len``, or the KV cache's capacity where that is smaller).

        ValueError when it leaves none; the engine core's own check (a prompt finishing as
        IGNORED) then never fires for requests from this front end.
        """
        max_model_len = self.model_config.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise ValueError(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has {num_prompt_tokens} tokens, leaving no room for the completion. "
                "Please reduce the length of the prompt."
            )
        max_num_kv_tokens = self.max_num_kv_tokens
        if max_num_kv_tokens is not None and num_prompt_tokens >= max_num_kv_tokens:
            raise ValueError(
                f"The KV cache holds {max_num_kv_tokens} tokens in all. However, your prompt has "
                f"{num_prompt_tokens} tokens, leaving no room for the completion. Please reduce "
                "the length of the prompt, or raise kv_cache_memory."
            )
        return self.max_num_tokens - num_prompt_tokens

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> TokenizedPrompt:
        """A prompt of the Python API (text, token ids, or a ``TokenizedPrompt`` passed through)."""
        if isinstance(prompt, TokenizedPrompt):
            return prompt
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenize_text(prompt, add_special_tokens)
        if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Sequence):
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        return self.tokenize_ids(prompt)

    def tokenize_text(
        self, text: str, add_special_tokens: bool = True, field: str = "prompt"
    ) -> TokenizedPrompt:
        """Prompt text to token ids (a text longer than any context is refused untokenized)."""
        token_ids = self.text_encoder.encode(text, add_special_tokens, field)
        if not token_ids:
            raise ValueError(f"{field} must not be empty (it has no tokens)")
        return TokenizedPrompt(text, token_ids)

    def tokenize_ids(
        self, token_ids: Sequence[int], field: str = "prompt_token_ids"
    ) -> TokenizedPrompt:
        """A prompt given as token ids: a flat, non-empty list within the vocabulary."""
        if len(token_ids) == 0:
            raise ValueError(f"{field} must not be empty (it has no tokens)")
        return TokenizedPrompt(None, self.check_token_ids(token_ids, field))

    def tokenize_chat(
        self,
        messages: Sequence[dict],
        tools: list[dict] | None = None,
        client_kwargs: dict | None = None,
        **options,
    ) -> TokenizedPrompt:
        """A conversation through the chat template (rendered once; message text stays plain
        text, see ``TextEncoder.encode_chat``)."""
        text, token_ids = self.text_encoder.encode_chat(messages, tools, client_kwargs, **options)
        if not token_ids:
            raise ValueError("messages render to an empty prompt")
        return TokenizedPrompt(text, token_ids)

    def check_token_ids(self, token_ids: Sequence[int], field: str) -> list[int]:
        """``token_ids`` as a list, if it is a flat list of integers within the vocabulary."""
        ids = _id_array(token_ids)
        if ids is None:
            raise ValueError(f"{field} must be a flat list of integers")
        vocab = self.model_config.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = ids[(ids < 0) | (ids >= vocab)][:5].tolist()
            raise ValueError(f"{field} holds token ids outside the vocabulary [0, {vocab}): {bad}")
        return ids.tolist()

    def make_requests(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """The engine core requests for one prompt: one, or ``n`` children sharing the prompt."""
        if not self.model_config.can_generate:
            raise ValueError(
                f"model {self.model_config.served_model_name!r} runs with runner='pooling': it "
                "embeds, classifies and scores, and does not generate text"
            )
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(params).__name__}"
            )
        # A copy checks every field again (types and ranges): a SamplingParams may have been
        # changed since it was built.
        params = params.clone()
        self._check(request_id, prompt_token_ids, params, priority)
        lora_request = self.loras.check(lora_request)
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
                child_params = engine_params.clone(
                    seed=child_seed(params.seed, index), prompt_logprobs=None
                )
            requests.append(
                EngineCoreRequest(
                    request_id=child_request_id(request_id, index, params.n),
                    prompt_token_ids=prompt_token_ids,
                    sampling_params=child_params,
                    eos_token_id=config.eos_token_id,
                    arrival_time=arrival,
                    priority=priority,
                    lora_request=lora_request,
                )
            )
        return requests

    def make_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> EngineCoreRequest:
        """The engine core request pooling one prompt (embed or classify); the engine's default
        pooling type fills an unset ``pooling_type``."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        params = params.clone()  # checks every field again
        config = self.model_config
        if params.task == "classify" and config.num_labels is None:
            raise ValueError(
                "this model cannot classify: it is not a sequence classification model "
                "(*ForSequenceClassification)"
            )
        if params.dimensions is not None and params.dimensions > config.hidden_size:
            raise ValueError(
                f"dimensions must be at most the model's hidden size {config.hidden_size}, "
                f"got {params.dimensions}"
            )
        if params.pooling_type is None and params.task == "embed":
            params = params.clone(pooling_type=config.pooling_type)
        self._check_request(request_id, priority)
        limit = self.max_num_tokens
        if len(prompt_token_ids) > limit:
            raise ValueError(
                f"This model's maximum input length is {limit} tokens. However, your input has "
                f"{len(prompt_token_ids)} tokens. Please reduce the length of the input."
            )
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=_POOLING_SAMPLING_PARAMS,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            pooling_params=params,
        )

    def _check_request(self, request_id: str, priority: int) -> None:
        """The checks every request shares: its id and its priority."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if not (
            isinstance(priority, int)
            and not isinstance(priority, bool)
            and INT64_MIN <= priority <= INT64_MAX
        ):
            raise ValueError(
                f"priority must be an int in [{INT64_MIN}, {INT64_MAX}], got {priority!r}"
            )
        if priority != 0 and self.model_config.scheduling_policy != "priority":
            raise ValueError(
                f"priority {priority} needs the priority scheduling policy "
                "(EngineArgs.scheduling_policy='priority', --scheduling-policy priority)"
            )

    def _check(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int
    ) -> None:
        self._check_request(request_id, priority)
        self.output_room(len(prompt_token_ids))
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be below the vocab size {vocab}")
        if params.structured_outputs is not None:
            # xgrammar (and torch) load only once a request asks for structured outputs.
            from ember_worker.structured_outputs import check_structured_outputs

            check_structured_outputs(params.structured_outputs)


def _id_array(token_ids) -> np.ndarray | None:
    """``token_ids`` as a 1-D integer array (of Python ints where they pass int64), or None
    when it is not a flat list of integers."""
    if isinstance(token_ids, (str, bytes, dict)) or not isinstance(token_ids, Sequence):
        return None
    try:
        ids = np.asarray(token_ids)
    except (ValueError, TypeError):  # ragged nesting
        return None
    if ids.ndim != 1:
        return None
    if ids.dtype.kind in "iu":
        return ids
    if ids.size == 0:
        return ids.astype(np.int64)
    if ids.dtype == object and all(type(t) is int for t in token_ids):
        return ids
    return None
