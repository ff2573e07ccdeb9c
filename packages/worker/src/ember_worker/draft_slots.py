"""Draft tokens held in the persistent batch, right after each row's known tokens.

A row's drafts sit in its token row at ``[num_tokens_no_spec, num_tokens)``: where the next step
feeds them to the target, and where a row move copies them along. After a step the proposer
leaves its drafts there (``hold``); the next step schedules them (``schedule``): the
scheduler's draft ids are written over them, except where it sends placeholders
(``DRAFT_PLACEHOLDER``, async scheduling: it schedules the drafts before it has seen them), which
take the held drafts as they are. Each row also records how many of its drafts the last step
accepted: under async scheduling the scheduler counts the drafts of a step in flight as
computed, and the worker takes the rejected ones back off (``verified_num_computed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ember_scheduler.outputs import DRAFT_PLACEHOLDER

if TYPE_CHECKING:
    from ember_worker.input_batch import InputBatch


class DraftSlots:
    """The draft tokens of one ``InputBatch``'s rows (its token rows hold them)."""

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        self.any = False  # some row's num_tokens counts draft tokens

    def drop(self) -> None:
        if self.any:
            self.batch.num_tokens[:] = self.batch.num_tokens_no_spec
            self.any = False

    def num_drafts(self) -> np.ndarray:
        """Drafts of rows ``0..num_reqs-1`` (int64)."""
        batch = self.batch
        n = batch.num_reqs
        return (batch.num_tokens[:n] - batch.num_tokens_no_spec[:n]).astype(np.int64)

    def draft_token_ids(self, k: int) -> np.ndarray:
        """``[num_reqs, k]`` int64: row ``i``'s drafts first, then padding (never read)."""
        batch = self.batch
        n = batch.num_reqs
        columns = batch.num_tokens_no_spec[:n, None].astype(np.int64) + np.arange(k)
        np.minimum(columns, batch.max_model_len - 1, out=columns)
        return batch.token_ids_cpu[np.arange(n)[:, None], columns].astype(np.int64)

    def hold(self, draft_token_ids: np.ndarray, num_drafts: np.ndarray) -> None:
        """Keep each row's proposed drafts (``draft_token_ids[i, :num_drafts[i]]``) after its
        known tokens, short of max_model_len."""
        batch = self.batch
        n = batch.num_reqs
        start = batch.num_tokens_no_spec[:n].astype(np.int64)
        counts = np.minimum(num_drafts.astype(np.int64), batch.max_model_len - start)
        total = int(counts.sum())
        if total:
            rows = np.repeat(np.arange(n), counts)
            offsets = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
            batch.token_ids_cpu[rows, start[rows] + offsets] = draft_token_ids[rows, offsets]
            self.any = True
        batch.num_tokens[:n] = start + counts

    def schedule(self, spec_decode_tokens: dict[str, list[int]], num_sched: np.ndarray) -> None:
        """Hold this step's drafts: the scheduler's, or the held ones where it sent
        placeholders. A row given fewer held drafts than placeholders runs fewer tokens
        (``num_sched`` shrinks in place); rows without drafts this step drop theirs."""
        if not spec_decode_tokens and not self.any:
            return  # no row holds drafts and none come: nothing to hold or drop
        batch = self.batch
        n = batch.num_reqs
        start = batch.num_tokens_no_spec[:n]
        held = batch.num_tokens[:n] - start
        keep = np.zeros(n, dtype=np.int64)
        for req_id, drafts in spec_decode_tokens.items():
            if not drafts:
                continue
            row = batch.row_of(req_id)
            if drafts[0] == DRAFT_PLACEHOLDER:
                keep[row] = min(len(drafts), int(held[row]))
                num_sched[row] -= len(drafts) - keep[row]
                continue
            end = start[row] + len(drafts)
            if end > batch.max_model_len:
                raise ValueError(
                    f"spec_decode_tokens of {req_id!r} would exceed max_model_len "
                    f"{batch.max_model_len}"
                )
            batch.token_ids_cpu[row, start[row] : end] = drafts
            keep[row] = len(drafts)
        batch.num_tokens[:n] = start + keep
        self.any = bool(keep.any())

    def record_accepted(self, num_new_tokens: np.ndarray) -> None:
        """Before a step's tokens are appended: each row's accepted drafts (all tokens but the
        last of a row that verified drafts; 0 otherwise)."""
        batch = self.batch
        n = batch.num_reqs
        verified = (batch.num_tokens[:n] > batch.num_tokens_no_spec[:n]) & (num_new_tokens > 0)
        batch.rows["num_accepted_drafts"][:n] = np.where(verified, num_new_tokens - 1, 0)

    def verified_num_computed(
        self, rows: np.ndarray, num_computed: np.ndarray, num_drafts_in_flight: list[int]
    ) -> np.ndarray:
        """The scheduler's ``num_computed_tokens`` of ``rows`` less the drafts it counted as
        accepted of each row's last step (``num_drafts_in_flight`` of them) that the step
        rejected."""
        in_flight = np.array(num_drafts_in_flight, dtype=np.int64)
        accepted = self.batch.rows["num_accepted_drafts"][rows]
        return num_computed - np.where(in_flight > 0, in_flight - accepted, 0)
