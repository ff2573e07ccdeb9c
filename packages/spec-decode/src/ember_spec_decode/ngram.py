"""Prompt lookup (n-gram) proposals, vectorized over the batch with numpy."""

from __future__ import annotations

import numpy as np

from ember_spec_decode.proposal import Proposal


class NgramProposer:
    """Proposes the tokens that followed an earlier occurrence of a request's last n tokens.

    For each row, the longest n in ``[min_n, max_n]`` whose last-n-token suffix also occurs
    earlier in the row's own tokens (prompt and outputs) wins; among occurrences of that
    suffix the earliest one is used (it has the most tokens after it), and up to ``k`` of the
    tokens that follow it are proposed (fewer when the row's tokens end sooner). Rows without a
    match of at least ``min_n`` tokens get no drafts.

    The whole batch is matched at once: for every candidate end position ``e`` of an earlier
    occurrence, ``max_n`` vectorized comparisons count how many tokens before and at ``e`` equal
    the row's suffix, with no Python loop over rows or positions.
    """

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        if k < 1:
            raise ValueError(f"NgramProposer.k must be positive, got {k}")
        self.min_n = min_n
        self.max_n = max_n
        self.num_speculative_tokens = k

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> Proposal:
        """Drafts for each row of ``token_ids[i, :num_tokens[i]]``."""
        num_tokens = np.asarray(num_tokens, dtype=np.int64)
        n, k = len(num_tokens), self.num_speculative_tokens
        drafts = np.zeros((n, k), dtype=np.int32)
        counts = np.zeros(n, dtype=np.int32)
        rows = np.flatnonzero(num_tokens > self.min_n)  # a match needs a token after it
        if rows.size == 0:
            return Proposal(drafts, counts)
        lengths = num_tokens[rows]
        width = int(lengths.max())
        tokens = np.asarray(token_ids)[rows, :width]
        last = lengths - 1
        # Candidate end positions e (the last token of an earlier occurrence): e < last.
        ends = np.arange(width - 1)
        valid = ends[None, :] < last[:, None]
        # match_len[r, e]: how many of the row's last tokens match going back from e, up to max_n.
        match_len = np.zeros((len(rows), width - 1), dtype=np.int32)
        running = valid
        for t in range(self.max_n):
            back = ends - t
            if back[-1] < 0:
                break
            suffix_token = tokens[np.arange(len(rows)), last - t]
            # positions e with e - t < 0 have no token there: they stop matching
            same = np.zeros_like(running)
            same[:, t:] = tokens[:, back[t:]] == suffix_token[:, None]
            # the suffix must not reach before the row's start either
            same &= (last - t >= 0)[:, None]
            running = running & same
            if not running.any():
                break
            match_len += running
        best = match_len.max(axis=1)
        found = best >= self.min_n
        if not found.any():
            return Proposal(drafts, counts)
        # The earliest end position with the longest match.
        end = np.argmax(match_len == best[:, None], axis=1)
        rows, end, lengths = rows[found], end[found], lengths[found]
        tokens = tokens[found]
        take = np.minimum(lengths - 1 - end, k)  # tokens after the match, up to k
        offsets = np.arange(k)
        source = np.minimum(end[:, None] + 1 + offsets[None, :], width - 1)
        drafts[rows] = np.take_along_axis(tokens, source, axis=1)
        counts[rows] = take
        return Proposal(drafts, counts)
