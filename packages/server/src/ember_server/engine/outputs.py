"""What ``LLM.generate`` returns and ``AsyncLLM.generate`` yields, in vLLM's shape."""

from __future__ import annotations

import dataclasses
import enum


@dataclasses.dataclass
class Logprob:
    """One token's log probability, its rank in the full distribution (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the chosen token and the top-N alternatives, keyed by token id.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it).
PromptLogprobs = list[dict[int, Logprob] | None]


class RequestOutputKind(enum.IntEnum):
    """What each yielded output holds: everything so far, only what is new, or only the end."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's ``n`` sequences.

    In a delta output ``text``, ``token_ids`` and ``logprobs`` hold only what is new since the
    previous output; ``cumulative_logprob`` is always the running total.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's prompt and its sequences; ``finished`` once every sequence is.

    ``num_cached_tokens``: prompt tokens served from the prefix cache (for ``n`` > 1, the most
    any one sequence got).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
