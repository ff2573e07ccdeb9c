"""The worker's half of speculative decoding: where drafts sit in the logits, how they are
verified, and the next drafts.

It plugs into the model runner's one sampling path rather than running beside it. A row with
drafts has its logits taken at each draft position and after the last one (``DraftLayout``), not
only at its last token; the sampler draws each row's token from its last position as for any
row; then ``verify`` replaces the rows with drafts by what ``ember_spec_decode.rejection_sample``
emits, given the target's processed distribution at each position (the row's temperature, min-p,
top-k and top-p, or a one-hot argmax for greedy rows), so the emitted tokens follow exactly what
the sampler alone would draw.

Requests with structured outputs speculate too: their drafts are cut at the first token their
grammar refuses, and each verified position's logits are masked with the grammar's state after
the drafts before it (``GrammarMatchers.apply_bitmask_with_drafts``); the matchers then advance
on the accepted tokens only.
Drafts come from prompt lookup (``NgramProposer``, run on the batch's token rows after the step's
tokens are appended) or from a draft model (``DraftModelProposer``), and are held in the batch
(``DraftSlots``) for the next step. Rows with penalties or still below ``min_tokens`` get no
drafts: their distribution at a draft position would depend on the drafts before it, which the
processed logits here do not model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember_scheduler.outputs import Logprobs
from ember_spec_decode import NgramProposer, Proposal, SpeculativeConfig, rejection_sample
from ember_worker.draft_model import DraftModelProposer
from ember_worker.input_batch import InputBatch
from ember_worker.layers.attention import AttentionMetadata
from ember_worker.model_inputs import ModelInputs
from ember_worker.model_loader import LoadedModel
from ember_worker.sampler import Sampler
from ember_worker.spec_sampling import ACCEPT_STREAM, processed_probs, uniforms
from ember_worker.step_tokens import StepTokens
from ember_worker.structured_outputs import GrammarMatchers


@dataclass
class DraftLayout:
    """Where each row's drafts and bonus position sit among this step's scheduled tokens."""

    num_drafts: np.ndarray  # int64 [num_reqs]
    draft_token_ids: np.ndarray  # int64 [num_reqs, k], padded
    logits_indices: torch.Tensor  # int64 [num_reqs + sum(num_drafts)]: drafts, then bonus
    last_index: np.ndarray  # int64 [num_reqs]: each row's bonus row within logits_indices

    @classmethod
    def build(cls, batch: InputBatch, k: int) -> DraftLayout:
        """From the drafts the batch holds for this step and its scheduled counts."""
        n = batch.num_reqs
        num_drafts = batch.drafts.num_drafts()
        per_row = num_drafts + 1
        ends = np.cumsum(per_row)
        query_ends = np.cumsum(batch.num_scheduled_tokens[:n].astype(np.int64))
        row_of = np.repeat(np.arange(n), per_row)
        offset = np.arange(int(ends[-1])) - (ends - per_row)[row_of]
        # Row i's last per_row[i] scheduled tokens: its drafts' inputs and its last token.
        positions = query_ends[row_of] - per_row[row_of] + offset
        return cls(
            num_drafts, batch.drafts.draft_token_ids(k), torch.from_numpy(positions), ends - 1
        )

    @property
    def first_rows(self) -> np.ndarray:
        """Each row's first verified position within ``logits_indices``."""
        return self.last_index - self.num_drafts

    def drafts_by_request(self, batch: InputBatch) -> dict[str, list[int]]:
        req_ids = batch.req_ids
        return {
            req_ids[row]: self.draft_token_ids[row, : self.num_drafts[row]].tolist()
            for row in np.flatnonzero(self.num_drafts).tolist()
        }


class SpeculativeDecoder:
    """Lays out and verifies a step's drafts with the rejection sampler; proposes the next."""

    def __init__(
        self,
        config: SpeculativeConfig,
        batch: InputBatch,
        target: LoadedModel,
        device: torch.device,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.batch = batch
        self.draft_model = None
        self.ngram = None
        if config.method == "draft_model":
            self.draft_model = DraftModelProposer(config, target, batch, device)
        else:
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max, self.k)

    def catch_up(self, inputs: ModelInputs, metadata: AttentionMetadata) -> None:
        """Write the draft model's KV for the tokens the target just ran over."""
        if self.draft_model is not None:
            self.draft_model.catch_up(inputs.input_ids, inputs.positions, metadata)

    def layout(self) -> DraftLayout | None:
        """This step's draft layout; None when no row verifies drafts."""
        return DraftLayout.build(self.batch, self.k) if self.batch.drafts.any else None

    def verify(
        self, logits: torch.Tensor, layout: DraftLayout, tokens: StepTokens
    ) -> tuple[np.ndarray, torch.Tensor]:
        """Replace, in ``tokens``, each row with drafts by its accepted drafts and one more.
        Returns those rows and their target logits (for ``fill_draft_logprobs``)."""
        spec_rows = np.flatnonzero(layout.num_drafts)
        target_logits = logits[torch.from_numpy(_runs(layout, spec_rows)).to(logits.device)]
        num_drafts = layout.num_drafts[spec_rows]
        state = self.batch.rows[spec_rows]
        per_row = torch.from_numpy(num_drafts + 1)
        valid = torch.arange(self.k + 1)[None, :] < per_row[:, None]
        offsets = np.arange(self.k + 1)[None, :].repeat(len(spec_rows), 0)
        out = rejection_sample(
            processed_probs(target_logits, np.repeat(state, num_drafts + 1)),
            torch.from_numpy(layout.draft_token_ids[spec_rows]),
            torch.from_numpy(num_drafts),
            uniform_accept=uniforms(state, offsets[:, : self.k], ACCEPT_STREAM),
            uniform_draw=uniforms(state, offsets)[valid],
            draft_probs=(
                None
                if self.draft_model is None
                else self.draft_model.take_draft_probs(spec_rows, num_drafts)
            ),
        )
        tokens.token_ids[spec_rows] = out.token_ids.cpu().numpy()
        tokens.num_tokens[spec_rows] = out.num_tokens.cpu().numpy()
        return spec_rows, target_logits

    def propose(self, tokens: StepTokens, grammar_matchers: GrammarMatchers | None) -> Proposal:
        """Drafts for the next step of every row that just got tokens and may speculate (after
        the step's tokens were appended); the batch holds them."""
        batch = self.batch
        n = batch.num_reqs
        lengths = batch.num_tokens_no_spec[:n].astype(np.int64)
        lengths = np.where((tokens.num_tokens > 0) & self._may_speculate(), lengths, 0)
        if self.draft_model is not None:
            proposal = self.draft_model.propose(np.flatnonzero(lengths))
        elif lengths.any():
            proposal = self.ngram.propose(batch.token_ids_cpu[:n], lengths)
        else:
            proposal = Proposal(np.zeros((n, self.k), np.int32), np.zeros(n, np.int32))
        if grammar_matchers:
            drafts = proposal.to_lists()
            grammar_matchers.cut_drafts(batch.req_id_to_index, drafts)
            proposal.num_draft_tokens = np.array([len(d) for d in drafts], dtype=np.int32)
        batch.drafts.hold(proposal.draft_token_ids, proposal.num_draft_tokens)
        return proposal

    def _may_speculate(self) -> np.ndarray:
        state = self.batch.rows[: self.batch.num_reqs]
        return (
            (state["presence_penalty"] == 0.0)
            & (state["frequency_penalty"] == 0.0)
            & (state["repetition_penalty"] == 1.0)
            & (state["num_tokens_no_spec"] - state["num_prompt_tokens"] >= state["min_tokens"])
        )

    def fill_draft_logprobs(
        self,
        logprobs: Logprobs,
        tokens: list[list[int]],
        target_logits: torch.Tensor,
        spec_rows: np.ndarray,
        num_drafts: np.ndarray,
    ) -> None:
        """Replace the placeholder rows of requests that asked for logprobs and emitted more
        than one token with the logprobs at each emitted position."""
        num_logprobs = self.batch.rows["num_logprobs"]
        first = np.cumsum(num_drafts + 1) - (num_drafts + 1)
        offsets = np.cumsum([len(t) for t in tokens]) - [len(t) for t in tokens]
        for i, row in enumerate(spec_rows.tolist()):
            if num_logprobs[row] < 0:
                continue
            run = tokens[row]
            start = int(first[i])
            rows = Sampler.compute_prompt_logprobs(
                target_logits[start : start + len(run)],
                torch.tensor(run, device=target_logits.device),
                int(num_logprobs[row]),
            )
            at = int(offsets[row])
            logprobs.token_ids[at : at + len(run)] = rows.token_ids
            logprobs.logprobs[at : at + len(run)] = rows.logprobs
            logprobs.ranks[at : at + len(run)] = rows.ranks


def _runs(layout: DraftLayout, rows: np.ndarray) -> np.ndarray:
    """Indices into ``layout.logits_indices`` of the given rows' draft and bonus positions."""
    counts = layout.num_drafts[rows] + 1
    starts = layout.last_index[rows] - layout.num_drafts[rows]
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]))
