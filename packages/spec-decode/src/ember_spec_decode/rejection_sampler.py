"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), vectorized over the batch.

Row ``i`` of a batch verifies ``d_i`` draft tokens ``x_1..x_{d_i}`` in one target forward, which
gives the target's distribution ``p_j`` at every draft position and ``p_{d_i+1}`` after the last
one. Draft ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, where ``q_j`` is
the distribution the draft was drawn from; at the first rejection the row ends with a token drawn
from ``normalize(max(0, p_j - q_j))``, and when every draft is accepted with a bonus token drawn
from ``p_{d_i+1}``. Every emitted token then follows ``p`` exactly, whatever ``q`` is. A draft
proposed without a distribution (prompt lookup, a greedy drafter) is a point mass,
``q_j = one_hot(x_j)``: accepted with probability ``p_j(x_j)``, and the residual is ``p_j`` without
``x_j``. A greedy row passes ``p`` as ``one_hot(argmax)``, which accepts exactly while the argmax
agrees and ends with the argmax.

The caller supplies ``p`` already processed (temperature, top-k, top-p, min-p ...): the sampler
is exact for whatever distribution it is given. It also supplies the uniforms, so that seeded
requests can derive theirs from (seed, position) and stay reproducible.

Layout: the target rows are flat, ``d_i + 1`` consecutive rows per request (its draft positions,
then the bonus position), in request order; the draft rows (when given) are flat too, ``d_i``
per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RejectionOutput:
    """Row ``i`` emits ``token_ids[i, :num_tokens[i]]``: its accepted drafts, then one token drawn
    at the first rejected position (or the bonus token). Entries past that are ``-1``."""

    token_ids: torch.Tensor  # int64 [num_reqs, k + 1]
    num_tokens: torch.Tensor  # int64 [num_reqs], each in [1, num_draft_tokens + 1]

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_tokens - 1

    def to_lists(self) -> list[list[int]]:
        return [
            row[:count] for row, count in zip(self.token_ids.tolist(), self.num_tokens.tolist())
        ]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    uniform_accept: torch.Tensor,
    uniform_draw: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> RejectionOutput:
    """Accept or reject each row's drafts and draw its last token.

    ``target_probs``: float ``[sum(d_i + 1), vocab]``, each row a distribution (any scale: rows
    are normalized where needed). ``draft_token_ids``: int ``[num_reqs, k]``, row ``i`` valid up
    to ``d_i = num_draft_tokens[i]``. ``uniform_accept``: ``[num_reqs, k]`` uniforms in [0, 1)
    for the accept tests. ``uniform_draw``: ``[sum(d_i + 1)]``, one uniform per target row, of
    which the row where a request ends draws its last token. ``draft_probs``: float
    ``[sum(d_i), vocab]``, the draft distributions; None for point-mass drafts.
    """
    num_reqs, k = draft_token_ids.shape
    device = target_probs.device
    num_drafts = num_draft_tokens.to(device=device, dtype=torch.int64)
    _check_shapes(
        target_probs, draft_token_ids, num_drafts, uniform_accept, uniform_draw, draft_probs
    )
    drafts = draft_token_ids.to(device=device, dtype=torch.int64)
    # Flat target row of each (request, draft position), and of each request's bonus position.
    first_row = torch.cumsum(num_drafts + 1, 0) - (num_drafts + 1)
    position = torch.arange(k, device=device)
    is_draft = position[None, :] < num_drafts[:, None]
    target_row = (first_row[:, None] + position[None, :]).clamp(max=target_probs.shape[0] - 1)
    safe_drafts = torch.where(is_draft, drafts, 0)

    target_mass = target_probs.sum(dim=-1, dtype=torch.float64)
    p_draft = target_probs[target_row, safe_drafts].to(torch.float64) / target_mass[target_row]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        draft_first = torch.cumsum(num_drafts, 0) - num_drafts
        draft_row = (draft_first[:, None] + position[None, :]).clamp(
            min=0, max=max(draft_probs.shape[0] - 1, 0)
        )
        draft_mass = draft_probs.sum(dim=-1, dtype=torch.float64)
        q_draft = draft_probs[draft_row, safe_drafts].to(torch.float64) / draft_mass[draft_row]
    # accept x with probability min(1, p/q): u < p/q, written without dividing by q
    accepted = (
        uniform_accept.to(device=device, dtype=torch.float64) * q_draft < p_draft
    ) & is_draft
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)

    # Each request ends at its first rejected draft, or at its bonus position.
    end_row = first_row + num_accepted
    final = target_probs[end_row].to(torch.float32)
    final = final / final.sum(dim=-1, keepdim=True)
    rejected = num_accepted < num_drafts
    if rejected.any():
        rows = torch.nonzero(rejected)[:, 0]
        at = num_accepted[rows]
        if draft_probs is None:
            q_final = torch.zeros_like(final[rows])
            q_final[torch.arange(len(rows), device=device), drafts[rows, at]] = 1.0
        else:
            q_final = draft_probs[draft_first[rows] + at].to(torch.float32)
            q_final = q_final / q_final.sum(dim=-1, keepdim=True)
        residual = (final[rows] - q_final).clamp_(min=0.0)
        # Rounding can leave nothing where p and q agree to float precision; p is exact there.
        empty = residual.sum(dim=-1) <= 0
        residual[empty] = final[rows][empty]
        final[rows] = residual
    last_token = _inverse_cdf(final, uniform_draw.to(device)[end_row])

    token_ids = torch.where(position[None, :] < num_accepted[:, None], drafts, -1)
    token_ids = torch.cat([token_ids, torch.full((num_reqs, 1), -1, device=device)], dim=1)
    token_ids.scatter_(1, num_accepted[:, None], last_token[:, None])
    return RejectionOutput(token_ids=token_ids, num_tokens=num_accepted + 1)


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of non-negative ``weights`` by its uniform in [0, 1); entries
    of zero weight are never drawn."""
    cumulative = weights.to(torch.float64).cumsum(dim=-1)
    target = uniform.to(torch.float64) * cumulative[:, -1]
    index = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
    return index.clamp_(max=weights.shape[-1] - 1)


def _check_shapes(
    target_probs, draft_token_ids, num_drafts, uniform_accept, uniform_draw, draft_probs
):
    num_reqs, k = draft_token_ids.shape
    if (
        num_drafts.shape != (num_reqs,)
        or bool((num_drafts < 0).any())
        or bool((num_drafts > k).any())
    ):
        raise ValueError(
            f"num_draft_tokens must be [{num_reqs}] with values in [0, {k}], got "
            f"{tuple(num_drafts.shape)} {num_drafts.tolist()}"
        )
    total = int(num_drafts.sum()) + num_reqs
    if target_probs.dim() != 2 or target_probs.shape[0] != total:
        raise ValueError(
            f"target_probs must be [{total}, vocab] (num_draft_tokens + 1 rows per request), "
            f"got {tuple(target_probs.shape)}"
        )
    if tuple(uniform_accept.shape) != (num_reqs, k):
        raise ValueError(
            f"uniform_accept must be [{num_reqs}, {k}], got {tuple(uniform_accept.shape)}"
        )
    if tuple(uniform_draw.shape) != (total,):
        raise ValueError(f"uniform_draw must be [{total}], got {tuple(uniform_draw.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (
        total - num_reqs,
        target_probs.shape[1],
    ):
        raise ValueError(
            f"draft_probs must be [{total - num_reqs}, {target_probs.shape[1]}] "
            f"(num_draft_tokens rows per request), got {tuple(draft_probs.shape)}"
        )
