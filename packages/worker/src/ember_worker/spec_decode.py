"""The worker's half of speculative decoding: verify scheduled drafts, propose the next ones.

One target forward covers each row's last known token and its drafts; the logits at every one of
those positions go to ``ember_spec_decode.rejection_sample`` with the target's processed
distribution (the row's temperature, min-p, top-k and top-p, or a one-hot argmax for greedy
rows), so the emitted tokens follow exactly what the sampler alone would draw. Rows without
drafts in the same batch are sampled by the ordinary ``Sampler``.

Requests with structured outputs speculate too: their drafts are cut at the first token their
grammar refuses, and each verified position's logits are masked with the grammar's state after
the drafts before it (``GrammarMatchers.apply_bitmask_with_drafts``); the matchers then advance
on the accepted tokens only.
Drafts come from prompt lookup (``NgramProposer``, run here on the batch's token rows after
sampling) or from a draft model (``DraftModelProposer``). Rows with penalties or still below
``min_tokens`` get no drafts: their distribution at a draft
position would depend on the drafts before it, which the processed logits here do not model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember_scheduler.outputs import Logprobs
from ember_spec_decode import NgramProposer, SpeculativeConfig, rejection_sample
from ember_worker.draft_model import DraftModelProposer
from ember_worker.input_batch import InputBatch
from ember_worker.layers.attention import AttentionMetadata
from ember_worker.model_loader import LoadedModel
from ember_worker.sampler import Sampler, SamplerOutput
from ember_worker.sampling_metadata import build_sampling_metadata
from ember_worker.spec_sampling import ACCEPT_STREAM, processed_probs, uniforms
from ember_worker.structured_outputs import GrammarMatchers


@dataclass
class DraftLayout:
    """Where each row's drafts and bonus position sit among this step's scheduled tokens."""

    num_drafts: np.ndarray  # int64 [num_reqs]
    draft_token_ids: np.ndarray  # int64 [num_reqs, k], padded
    logits_indices: torch.Tensor  # int64 [num_reqs + sum(num_drafts)]: drafts, then bonus
    last_index: np.ndarray  # int64 [num_reqs]: each row's bonus row within logits_indices

    @classmethod
    def build(
        cls,
        batch: InputBatch,
        spec_decode_tokens: dict[str, list[int]],
        query_start_loc: np.ndarray,
        k: int,
    ) -> DraftLayout:
        n = batch.num_reqs
        num_drafts = np.zeros(n, dtype=np.int64)
        drafts = np.zeros((n, k), dtype=np.int64)
        index = batch.req_id_to_index
        for req_id, tokens in spec_decode_tokens.items():
            row = index[req_id]
            num_drafts[row] = len(tokens)
            drafts[row, : len(tokens)] = tokens
        per_row = num_drafts + 1
        ends = np.cumsum(per_row)
        row_of = np.repeat(np.arange(n), per_row)
        offset = np.arange(int(ends[-1])) - (ends - per_row)[row_of]
        # Row i's last per_row[i] scheduled tokens: its drafts' inputs and its last token.
        positions = query_start_loc[1:][row_of] - per_row[row_of] + offset
        return cls(num_drafts, drafts, torch.from_numpy(positions), ends - 1)


class SpeculativeDecoder:
    """Verifies drafts with the rejection sampler and proposes each row's next drafts."""

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

    def step(
        self,
        model: torch.nn.Module,
        hidden_states: torch.Tensor,
        sampler: Sampler,
        grammar_matchers: GrammarMatchers | None,
        num_scheduled: np.ndarray,
        spec_decode_tokens: dict[str, list[int]],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[list[list[int]], Logprobs | None, list[list[int]]]:
        """Sample this step's tokens, append them to the batch and propose the next drafts.

        Returns each row's new tokens (accepted drafts and one more; one token for a row
        without drafts; none mid-prefill), one logprobs row per token in row order (None when
        no row asked), and each row's drafts for the next step.
        """
        batch = self.batch
        n = batch.num_reqs
        if self.draft_model is not None:
            self.draft_model.catch_up(input_ids, positions, metadata)
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        layout = DraftLayout.build(batch, spec_decode_tokens, query_start_loc, self.k)
        logits = model.compute_logits(hidden_states[layout.logits_indices.to(hidden_states.device)])
        if grammar_matchers:
            grammar_matchers.apply_bitmask_with_drafts(
                logits,
                batch.req_id_to_index,
                layout.last_index - layout.num_drafts,
                spec_decode_tokens,
            )
        last_logits = logits[layout.last_index]
        sampler_output = sampler(last_logits, build_sampling_metadata(batch))
        computed = batch.num_computed_tokens[:n]
        reached_end = (computed + num_scheduled >= batch.num_tokens_no_spec[:n]) & (
            num_scheduled > 0
        )
        tokens, logprobs = self._sample(
            logits, layout, sampler_output, reached_end, spec_decode_tokens
        )
        batch.append_sampled_tokens(tokens)
        if grammar_matchers:
            grammar_matchers.accept_sampled(batch.req_id_to_index, tokens)
        return tokens, logprobs, self._propose(tokens, grammar_matchers)

    def _sample(
        self,
        logits: torch.Tensor,
        layout: DraftLayout,
        sampler_output: SamplerOutput,
        reached_end: np.ndarray,
        spec_decode_tokens: dict[str, list[int]],
    ) -> tuple[list[list[int]], Logprobs | None]:
        spec_rows = np.flatnonzero(layout.num_drafts)
        sampled = sampler_output.sampled_token_ids.tolist()
        tokens = [[t] if ok else [] for t, ok in zip(sampled, reached_end.tolist())]
        if spec_rows.size == 0:
            return tokens, logprobs_per_token(sampler_output, tokens)
        target_rows = torch.from_numpy(_runs(layout, spec_rows))
        target_logits = logits[target_rows]
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
                else self.draft_model.take_draft_probs(spec_decode_tokens)
            ),
        )
        accepted = out.to_lists()
        for row, run in zip(spec_rows.tolist(), accepted):
            tokens[row] = run
        logprobs = logprobs_per_token(sampler_output, tokens)
        if logprobs is not None:
            self._fill_draft_logprobs(logprobs, tokens, target_logits, spec_rows, num_drafts)
        return tokens, logprobs

    def _propose(
        self, new_tokens: list[list[int]], grammar_matchers: GrammarMatchers | None
    ) -> list[list[int]]:
        """Drafts for the next step of every row that just got tokens and may speculate."""
        batch = self.batch
        n = batch.num_reqs
        lengths = batch.num_tokens_no_spec[:n].astype(np.int64)
        got = np.fromiter((bool(t) for t in new_tokens), dtype=bool, count=n)
        lengths = np.where(got & self._may_speculate(), lengths, 0)
        if self.draft_model is not None:
            drafts = self.draft_model.propose(np.flatnonzero(lengths)).to_lists()
        elif lengths.any():
            drafts = self.ngram.propose(batch.token_ids_cpu[:n], lengths).to_lists()
        else:
            return [[] for _ in range(n)]
        if grammar_matchers:
            grammar_matchers.cut_drafts(batch.req_id_to_index, drafts)
        return drafts

    def _may_speculate(self) -> np.ndarray:
        state = self.batch.rows[: self.batch.num_reqs]
        return (
            (state["presence_penalty"] == 0.0)
            & (state["frequency_penalty"] == 0.0)
            & (state["repetition_penalty"] == 1.0)
            & (state["num_tokens_no_spec"] - state["num_prompt_tokens"] >= state["min_tokens"])
        )

    def _fill_draft_logprobs(
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


def logprobs_per_token(sampler_output: SamplerOutput, tokens: list[list[int]]) -> Logprobs | None:
    """One row per emitted token in row order, as the scheduler reads them: the sampler's row
    for a one-token row that asked, empty rows otherwise (the caller fills in runs of accepted
    drafts)."""
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
