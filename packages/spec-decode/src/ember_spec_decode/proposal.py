"""What a proposer returns: up to k draft tokens per request, padded into one array."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass
class Proposal:
    """Draft tokens of a batch: row ``i`` proposes ``draft_token_ids[i, :num_draft_tokens[i]]``
    (entries past that are padding and never read)."""

    draft_token_ids: np.ndarray  # int32 [num_reqs, k]
    num_draft_tokens: np.ndarray  # int32 [num_reqs], each in [0, k]

    def to_lists(self) -> list[list[int]]:
        """One list of drafts per row, as ``ModelRunnerOutput.spec_token_ids`` carries them."""
        return [
            row[:count].tolist()
            for row, count in zip(self.draft_token_ids, self.num_draft_tokens.tolist())
        ]


class TokenProposer(Protocol):
    """Proposes drafts from the batch's token state alone (no model): ``token_ids[i, :n]`` with
    ``n = num_tokens[i]`` is row ``i``'s prompt and outputs; a row with ``num_tokens[i] == 0``
    gets no drafts."""

    num_speculative_tokens: int

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> Proposal: ...
