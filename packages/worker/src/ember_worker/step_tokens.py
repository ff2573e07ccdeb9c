"""One step's new tokens per row, padded into one array, and what goes out with them.

The model runner's one sampling path fills a ``StepTokens``: one token per row that reaches the
end of its tokens, then, for rows that verified drafts, their accepted drafts and one more. The
batch appends it as it is (``InputBatch.append_token_runs``). Under pipeline parallelism the last
stage packs it with the next drafts into one tensor that every stage receives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember_scheduler.outputs import Logprobs
from ember_spec_decode import Proposal
from ember_worker.sampler import SamplerOutput


@dataclass
class StepTokens:
    """Row ``i`` emits ``token_ids[i, :num_tokens[i]]`` (entries past that are padding)."""

    token_ids: np.ndarray  # int64 [num_reqs, width]: width is 1 + num_speculative_tokens
    num_tokens: np.ndarray  # int64 [num_reqs]

    @classmethod
    def one_per_row(cls, sampled: torch.Tensor, reached_end: np.ndarray, width: int) -> StepTokens:
        """The sampler's token of each row that reached the end of its tokens."""
        token_ids = np.zeros((len(reached_end), width), dtype=np.int64)
        token_ids[:, 0] = sampled.cpu().numpy()
        return cls(token_ids, reached_end.astype(np.int64))

    def to_lists(self) -> list[list[int]]:
        return [row[:c] for row, c in zip(self.token_ids.tolist(), self.num_tokens.tolist())]


def logprobs_per_token(sampler_output: SamplerOutput, tokens: list[list[int]]) -> Logprobs | None:
    """One row per emitted token in row order, as the scheduler reads them: the sampler's row
    for a one-token row that asked, empty rows otherwise (the speculative decoder fills in runs
    of accepted drafts)."""
    if sampler_output.logprobs is None:
        return None
    asked = dict(zip(sampler_output.logprobs_rows, range(len(sampler_output.logprobs_rows))))
    got = sampler_output.logprobs
    result = Logprobs([], [], [])
    for row, run in enumerate(tokens):
        i = asked.get(row)
        for _ in run:
            if i is None or len(run) > 1:
                result.token_ids.append([])
                result.logprobs.append([])
                result.ranks.append(0)
            else:
                result.token_ids.append(got.token_ids[i])
                result.logprobs.append(got.logprobs[i])
                result.ranks.append(got.ranks[i])
    return result


def pack(tokens: StepTokens, drafts: Proposal | None, k: int) -> torch.Tensor:
    """``[num_reqs, 2 + width + k]`` int64: token count, tokens, draft count, drafts."""
    n, width = tokens.token_ids.shape
    packed = np.zeros((n, 2 + width + k), dtype=np.int64)
    packed[:, 0] = tokens.num_tokens
    packed[:, 1 : 1 + width] = tokens.token_ids
    if drafts is not None:
        packed[:, 1 + width] = drafts.num_draft_tokens
        packed[:, 2 + width :] = drafts.draft_token_ids
    return torch.from_numpy(packed)


def unpack(packed: torch.Tensor, width: int, k: int) -> tuple[StepTokens, Proposal | None]:
    values = packed.cpu().numpy()
    tokens = StepTokens(values[:, 1 : 1 + width].copy(), values[:, 0].copy())
    if not k:
        return tokens, None
    return tokens, Proposal(values[:, 2 + width :].copy(), values[:, 1 + width].copy())
