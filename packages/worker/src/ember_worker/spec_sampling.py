"""Per-position sampling distributions and uniforms for speculative decoding.

The rejection sampler needs the distribution the ``Sampler`` would draw from at a position, not
one drawn token: ``processed_probs`` applies the same transforms (temperature, min-p, top-k,
top-p; a one-hot argmax for greedy rows) and returns probabilities. ``uniforms`` gives the
random numbers, from (seed, output position, stream) for seeded rows, as the sampler does.
"""

from __future__ import annotations

import numpy as np
import torch

from ember_worker.sampling_metadata import GREEDY_TEMPERATURE
from ember_worker.sampling_ops import apply_min_p_, argmax_rows, top_k_top_p_candidates
from ember_worker.sampling_random import seeded_uniform

# Seeds of the separate counter-based streams a seeded row draws from (the draw of a token
# itself uses the seed as is, like the sampler).
ACCEPT_STREAM = 0x2545F4914F6CDD1D
DRAFT_STREAM = 0x1B873593CC9E2D51


def processed_probs(logits: torch.Tensor, state: np.ndarray) -> torch.Tensor:
    """The distribution each row of ``[n, vocab]`` logits is sampled from under the sampling
    parameters in ``state`` (the input batch's row records, one per logits row)."""
    device = logits.device
    logits = logits.to(torch.float32)
    greedy = state["temperature"] < GREEDY_TEMPERATURE
    one_hot = None
    if greedy.any():
        one_hot = torch.nn.functional.one_hot(argmax_rows(logits), logits.shape[-1]).float()
        if greedy.all():
            return one_hot

    def column(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device)

    temperature = np.where(greedy, 1.0, state["temperature"]).astype(np.float32)
    logits = logits / column(temperature)[:, None]
    if (state["min_p"] > 0).any():
        logits = apply_min_p_(logits, column(state["min_p"]))
    top_k = column(state["top_k"]) if (state["top_k"] > 0).any() else None
    top_p = column(state["top_p"]) if (state["top_p"] < 1.0).any() else None
    if top_k is not None or top_p is not None:
        values, ids = top_k_top_p_candidates(logits, top_k, top_p)
        logits = (
            values if ids is None else torch.full_like(logits, -torch.inf).scatter_(1, ids, values)
        )
    probs = logits.softmax(dim=-1)
    if one_hot is not None:
        probs = torch.where(column(greedy)[:, None], one_hot, probs)
    return probs


def uniforms(state: np.ndarray, offsets: np.ndarray, stream: int = 0) -> torch.Tensor:
    """One float64 uniform per (row, offset): row ``i`` of ``state`` at output position
    ``num_outputs_i + offsets[i, j]``. Seeded rows take theirs from (seed ^ stream, position);
    the others from torch's generator. ``offsets`` is ``[rows, m]``."""
    values = torch.rand(offsets.shape, dtype=torch.float64)
    seeded = state["has_seed"]
    if seeded.any():
        num_outputs = (state["num_tokens_no_spec"] - state["num_prompt_tokens"]).astype(np.int64)
        steps = torch.from_numpy(num_outputs[:, None] + offsets)
        seeds = torch.from_numpy(state["seed"].astype(np.int64) ^ stream)[:, None]
        values = torch.where(
            torch.from_numpy(seeded)[:, None], seeded_uniform(seeds.expand_as(steps), steps), values
        )
    return values
