"""The stop ids a request may not sample yet: EOS and its stop_token_ids below ``min_tokens``.

Keyed by request id, so that the batch's row moves need not touch it; a request leaves it when
appended tokens take it to min_tokens. Empty in the common case, which then costs nothing.
"""

from __future__ import annotations

import numpy as np

from ember_scheduler.outputs import NewRequestData


class MinTokensStops:
    """Token ids masked per request while it has fewer than ``min_tokens`` outputs."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._stop_ids: dict[str, np.ndarray] = {}

    def add_request(self, new_req: NewRequestData) -> int:
        """Hold the request's stop ids if it is below min_tokens; returns the min_tokens its
        row records (0: nothing to mask, also when it has no stop id inside the vocabulary)."""
        params = new_req.sampling_params
        if params.min_tokens <= len(new_req.output_token_ids):
            return 0
        ids = list(params.stop_token_ids)
        if new_req.eos_token_id is not None and not params.ignore_eos:
            ids.append(new_req.eos_token_id)
        unique = np.unique(np.asarray(ids, dtype=np.int64))
        # The model can never sample an id past the vocabulary: those need no mask.
        unique = unique[unique < self.vocab_size]
        if not len(unique):
            return 0
        self._stop_ids[new_req.req_id] = unique
        return params.min_tokens

    def remove_request(self, req_id: str) -> None:
        self._stop_ids.pop(req_id, None)

    def drop_reached(self, rows: np.ndarray, req_id_to_index: dict[str, int]) -> None:
        """Forget the requests whose outputs reached min_tokens (``rows``: the batch's row
        records; outputs only grow, so they never come back)."""
        pending = self._stop_ids
        if not pending:
            return
        req_ids = list(pending)
        state = rows[[req_id_to_index[r] for r in req_ids]]
        below = state["num_tokens_no_spec"] - state["num_prompt_tokens"] < state["min_tokens"]
        if not below.all():
            self._stop_ids = {r: pending[r] for r, keep in zip(req_ids, below.tolist()) if keep}

    def mask(self, req_id_to_index: dict[str, int]) -> tuple[np.ndarray, np.ndarray] | None:
        """``(rows, token_ids)`` as int64 index arrays, None when no request is below."""
        pending = self._stop_ids
        if not pending:
            return None
        rows = np.array([req_id_to_index[r] for r in pending], dtype=np.int64)
        stop_ids = list(pending.values())
        return np.repeat(rows, [len(ids) for ids in stop_ids]), np.concatenate(stop_ids)
