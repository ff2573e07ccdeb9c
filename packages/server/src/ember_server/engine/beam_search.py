"""Beam search as a loop outside the engine core, as vLLM keeps it: each step asks the engine for
one token of every live beam with its top ``2 * beam_width`` logprobs (beams of one prompt share
their prefix through the prefix cache), and ``BeamSearch`` keeps the ``beam_width`` best
continuations. ``LLM.beam_search`` drives it offline, the completions route (``use_beam_search``)
over ``AsyncLLM``; ordinary requests never pass through it.

A beam ends at EOS (unless ``ignore_eos``) or after ``max_tokens`` tokens; every candidate
ending in EOS is kept aside, the ``beam_width`` most likely others live on. The sequences
returned are the ``beam_width`` best of the ended and live beams by
``cum_logprob / length ** length_penalty``, the length counting the prompt and the generated
tokens but not a final EOS (vLLM's score).
"""

from __future__ import annotations

import dataclasses

from ember_scheduler.sampling_params import MAX_LOGPROBS, SamplingParams
from ember_server.engine.outputs import Logprob

MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each step ranks 2 * beam_width candidates per beam


@dataclasses.dataclass
class BeamSearchParams:
    """The settings of one beam search; ValueError naming the field for a bad value."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BeamSearchParams.{name} must be an integer >= 1, got {value!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(
                f"BeamSearchParams.beam_width must be at most {MAX_BEAM_WIDTH}, "
                f"got {self.beam_width}"
            )

    def step_params(self) -> SamplingParams:
        """One step of every beam: one token, the top ``2 * beam_width`` logprobs."""
        return SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True
        )


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's and the generated ones; ``text`` the generated
    tokens' text (set on the returned sequences)."""

    tokens: list[int]
    cum_logprob: float = 0.0
    finished: bool = False
    text: str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """The best sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearch:
    """The beams of one prompt, advanced one step at a time from the engine's logprobs."""

    def __init__(
        self, prompt_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int]
    ) -> None:
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.ended: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def advance(self, steps: list[dict[int, Logprob]]) -> None:
        """Extend every live beam by its ``2 * beam_width`` most likely tokens (``steps[i]``:
        live beam ``i``'s logprobs): a continuation by EOS ends (unless ``ignore_eos``), and the
        ``beam_width`` best of the others live on, as in vLLM."""
        width = self.params.beam_width
        candidates = []
        for beam, step in zip(self.live, steps):
            ranked = sorted(step.items(), key=lambda kv: -kv[1].logprob)[: 2 * width]
            for token_id, logprob in ranked:
                candidate = BeamSearchSequence(
                    [*beam.tokens, token_id], beam.cum_logprob + logprob.logprob
                )
                if not self.params.ignore_eos and token_id in self.eos_token_ids:
                    candidate.finished = True
                    self.ended.append(candidate)
                else:
                    candidates.append(candidate)
        candidates.sort(key=lambda beam: -beam.cum_logprob)
        self.live = candidates[:width]
        self.steps += 1

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (1 if beam.finished else 0)
        return beam.cum_logprob / (length**self.params.length_penalty)

    def best(self) -> list[BeamSearchSequence]:
        """The ``beam_width`` best sequences, ended and live, best first."""
        return sorted(self.ended + self.live, key=self.score, reverse=True)[
            : self.params.beam_width
        ]


def eos_token_ids(model_config) -> frozenset[int]:
    """The ids that end a beam: the model's EOS and its generation config's further ones."""
    ids = set(model_config.extra_eos_token_ids)
    if model_config.eos_token_id is not None:
        ids.add(model_config.eos_token_id)
    return frozenset(ids)


def finished_sequences(search: BeamSearch, tokenizer) -> BeamSearchOutput:
    """The search's best sequences, with the text of their generated tokens."""
    return BeamSearchOutput(
        [
            dataclasses.replace(beam, text=tokenizer.decode(beam.tokens[search.prompt_len :]))
            for beam in search.best()
        ]
    )
