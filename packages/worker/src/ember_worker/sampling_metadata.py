"""Per-row sampling inputs of one step, gathered from the persistent batch as tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from ember_worker.input_batch import InputBatch

GREEDY_TEMPERATURE = 1e-5  # below this a row is greedy, as SamplingParams.greedy says


@dataclass
class SamplingMetadata:
    """What the sampler needs for rows ``0..num_reqs-1``; ``None`` where no row uses a feature.

    ``seeds``/``num_output_tokens`` key a seeded row's randomness on (seed, output length), so a
    seeded row draws the same sample whatever else is in the batch and after preemption.
    """

    temperature: torch.Tensor  # float32 [n]
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # float32 [n]; 1.0 disables
    top_k: torch.Tensor | None  # int64 [n]; 0 disables
    min_p: torch.Tensor | None  # float32 [n]; 0.0 disables
    presence_penalties: torch.Tensor | None  # float32 [n]
    frequency_penalties: torch.Tensor | None  # float32 [n]
    repetition_penalties: torch.Tensor | None  # float32 [n]
    output_token_counts: torch.Tensor | None  # int32 [n, vocab]: occurrences in the output
    prompt_token_mask: torch.Tensor | None  # bool [n, vocab]: occurs in the prompt
    has_seed: torch.Tensor | None  # bool [n]
    seeds: torch.Tensor | None  # int64 [n]
    num_output_tokens: torch.Tensor | None  # int64 [n]
    num_logprobs: list[int]  # per row; -1: none asked
    max_num_logprobs: int | None  # None when no row asked

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None


def build_sampling_metadata(batch: InputBatch, device: torch.device) -> SamplingMetadata:
    n = batch.num_reqs
    state = batch.rows[:n]

    def tensor(field: str, dtype=None) -> torch.Tensor:
        values = np.ascontiguousarray(state[field])
        t = torch.from_numpy(values if dtype is None else values.astype(dtype))
        return t.to(device, non_blocking=True)

    temperature = state["temperature"]
    greedy = temperature < GREEDY_TEMPERATURE
    all_greedy = bool(greedy.all())
    all_random = not bool(greedy.any())
    sampled_rows = ~greedy  # parameters of greedy rows never matter

    def used(field: str, neutral) -> torch.Tensor | None:
        return tensor(field) if np.any(state[field][sampled_rows] != neutral) else None

    penalized = (
        (state["presence_penalty"] != 0.0)
        | (state["frequency_penalty"] != 0.0)
        | (state["repetition_penalty"] != 1.0)
    )
    counts = mask = None
    if penalized.any():
        counts, mask = _token_occurrences(batch, np.flatnonzero(penalized), device)

    seeded = state["has_seed"] & sampled_rows
    num_logprobs = state["num_logprobs"].tolist()
    max_num_logprobs = max(num_logprobs, default=-1)
    return SamplingMetadata(
        temperature=tensor("temperature"),
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=None if all_greedy else used("top_p", 1.0),
        top_k=None if all_greedy else used("top_k", 0),
        min_p=None if all_greedy else used("min_p", 0.0),
        presence_penalties=tensor("presence_penalty") if counts is not None else None,
        frequency_penalties=tensor("frequency_penalty") if counts is not None else None,
        repetition_penalties=tensor("repetition_penalty") if counts is not None else None,
        output_token_counts=counts,
        prompt_token_mask=mask,
        has_seed=tensor("has_seed") if seeded.any() else None,
        seeds=tensor("seed") if seeded.any() else None,
        num_output_tokens=(
            torch.from_numpy(
                (state["num_tokens_no_spec"] - state["num_prompt_tokens"]).astype(np.int64)
            ).to(device)
            if seeded.any()
            else None
        ),
        num_logprobs=num_logprobs,
        max_num_logprobs=None if max_num_logprobs < 0 else max_num_logprobs,
    )


def _token_occurrences(
    batch: InputBatch, rows: np.ndarray, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output-token counts and prompt-token presence of the given rows, ``[num_reqs, vocab]``.

    Only each row's valid tokens (prompt + output, no drafts) are read, gathered in one flat
    index over the rows.
    """
    n = batch.num_reqs
    lengths = batch.num_tokens_no_spec[rows].astype(np.int64)
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    row_of = np.repeat(rows, lengths)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
    tokens = batch.token_ids_cpu.reshape(-1)[row_of * batch.max_model_len + offsets]
    is_output = offsets >= batch.num_prompt_tokens[row_of]

    def on_device(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int64)).to(device)

    counts = torch.zeros((n, batch.vocab_size), dtype=torch.int32, device=device)
    out_rows, out_tokens = row_of[is_output], tokens[is_output]
    counts.index_put_(
        (on_device(out_rows), on_device(out_tokens)),
        torch.ones(1, dtype=torch.int32, device=device).expand(len(out_rows)),
        accumulate=True,
    )
    mask = torch.zeros((n, batch.vocab_size), dtype=torch.bool, device=device)
    in_prompt = ~is_output
    mask[on_device(row_of[in_prompt]), on_device(tokens[in_prompt])] = True
    return counts, mask
