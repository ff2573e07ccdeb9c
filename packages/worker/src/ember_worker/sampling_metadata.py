"""Per-row sampling inputs of one step, gathered from the persistent batch as tensors.

``build_sampling_metadata`` only reads the batch: what a row's state says (its parameters, its
tokens, whether it is still below min_tokens) is what the sampler gets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ember_scheduler.sampling_params import GREEDY_TEMPERATURE
from ember_worker.input_batch import InputBatch


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
    top_k: torch.Tensor | None  # int32 [n]; 0 disables
    min_p: torch.Tensor | None  # float32 [n]; 0.0 disables
    presence_penalties: torch.Tensor | None  # float32 [n]
    frequency_penalties: torch.Tensor | None  # float32 [n]
    repetition_penalties: torch.Tensor | None  # float32 [n]
    output_token_counts: torch.Tensor | None  # float32 [n, vocab]: occurrences in the output
    prompt_token_mask: torch.Tensor | None  # bool [n, vocab]: occurs in the prompt (repetition)
    has_seed: torch.Tensor | None  # bool [n]
    seeds: torch.Tensor | None  # int64 [n]
    num_output_tokens: torch.Tensor | None  # int64 [n]
    num_logprobs: list[int]  # per row; -1: none asked
    max_num_logprobs: int | None  # None when no row asked
    # (rows, token ids), int64 [k] each: logits set to -inf, EOS and stop ids of rows below
    # min_tokens; None when no row needs it (the usual case)
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_counts is None


class SamplingMetadataBuilder:
    """``build_sampling_metadata`` of one batch for its steps: the metadata of a step is kept
    for the next while the batch's rows stay as they were (``InputBatch.rows_version``) and it
    holds nothing that changes from step to step. Penalties (output counts), seeded rows (output
    lengths) and min_tokens masks change, so a batch with any of them is gathered every step."""

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        self._kept: SamplingMetadata | None = None
        self._version = -1

    def build(self) -> SamplingMetadata:
        batch = self.batch
        if self._kept is not None and self._version == batch.rows_version:
            return self._kept
        metadata = build_sampling_metadata(batch)
        steady = (
            metadata.no_penalties and metadata.has_seed is None and metadata.min_tokens_mask is None
        )
        self._kept, self._version = (metadata if steady else None), batch.rows_version
        return metadata


def build_sampling_metadata(batch: InputBatch) -> SamplingMetadata:
    """Sampling parameters and penalty inputs of rows ``0..num_reqs-1``, on the batch's device."""
    batch.check_condensed("build_sampling_metadata")
    device = batch.device
    n = batch.num_reqs
    state = batch.rows[:n]

    def to_device(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device, non_blocking=True)

    temperature = state["temperature"]
    greedy = temperature < GREEDY_TEMPERATURE
    all_greedy = bool(greedy.all())
    all_random = not bool(greedy.any())

    def truncation(field: str, neutral, greedy_value) -> torch.Tensor | None:
        """The row values, or None when no sampled row uses the feature. Greedy rows get
        ``greedy_value`` (equivalent to greedy), so they never widen the work of the others."""
        values = state[field]
        if all_greedy or not np.any(values[~greedy] != neutral):
            return None
        return to_device(np.where(greedy, greedy_value, values).astype(values.dtype))

    presence_used = state["presence_penalty"] != 0.0
    frequency_used = state["frequency_penalty"] != 0.0
    repetition_used = state["repetition_penalty"] != 1.0
    penalized = presence_used | frequency_used | repetition_used
    counts = mask = presence = frequency = repetition = None
    if penalized.any():
        counts, mask = _token_occurrences(
            batch, np.flatnonzero(penalized), device, with_prompt=bool(repetition_used.any())
        )
        if presence_used.any():
            presence = to_device(state["presence_penalty"])
        if frequency_used.any():
            frequency = to_device(state["frequency_penalty"])
        if repetition_used.any():
            repetition = to_device(state["repetition_penalty"])

    seeded = state["has_seed"] & ~greedy
    has_seed = seeds = num_output_tokens = None
    if seeded.any():
        has_seed = to_device(seeded)
        seeds = to_device(state["seed"])
        num_output_tokens = to_device(
            (state["num_tokens_no_spec"] - state["num_prompt_tokens"]).astype(np.int64)
        )
    num_logprobs = state["num_logprobs"].tolist()
    min_tokens_mask = batch.min_tokens_stop_mask()
    if min_tokens_mask is not None:
        min_tokens_mask = (to_device(min_tokens_mask[0]), to_device(min_tokens_mask[1]))
    max_num_logprobs = max(num_logprobs, default=-1)
    return SamplingMetadata(
        temperature=to_device(temperature),
        all_greedy=all_greedy,
        all_random=all_random,
        top_p=truncation("top_p", 1.0, 1.0),
        top_k=truncation("top_k", 0, 1),
        min_p=truncation("min_p", 0.0, 0.0),
        presence_penalties=presence,
        frequency_penalties=frequency,
        repetition_penalties=repetition,
        output_token_counts=counts,
        prompt_token_mask=mask,
        has_seed=has_seed,
        seeds=seeds,
        num_output_tokens=num_output_tokens,
        num_logprobs=num_logprobs,
        max_num_logprobs=None if max_num_logprobs < 0 else max_num_logprobs,
        min_tokens_mask=min_tokens_mask,
    )


def _token_occurrences(
    batch: InputBatch, rows: np.ndarray, device: torch.device, with_prompt: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Output-token counts (and, ``with_prompt``, prompt-token presence) of the given rows,
    as ``[num_reqs, vocab]`` tensors.

    Only each row's valid tokens (prompt + output, no drafts) are read, gathered in one flat
    index over the rows; the prompt part is skipped when no row needs it.
    """
    n = batch.num_reqs
    prompt_lens = batch.num_prompt_tokens[rows].astype(np.int64)
    first = np.zeros_like(prompt_lens) if with_prompt else prompt_lens
    lengths = batch.num_tokens_no_spec[rows].astype(np.int64) - first
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    row_of = np.repeat(rows, lengths)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(starts - first, lengths)
    tokens = batch.token_ids_cpu.reshape(-1)[row_of * batch.max_model_len + offsets]
    is_output = offsets >= np.repeat(prompt_lens, lengths)

    def on_device(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int64)).to(device)

    counts = torch.zeros((n, batch.vocab_size), dtype=torch.float32, device=device)
    out_rows, out_tokens = row_of[is_output], tokens[is_output]
    counts.index_put_(
        (on_device(out_rows), on_device(out_tokens)),
        torch.ones(1, dtype=torch.float32, device=device).expand(len(out_rows)),
        accumulate=True,
    )
    if not with_prompt:
        return counts, None
    mask = torch.zeros((n, batch.vocab_size), dtype=torch.bool, device=device)
    in_prompt = ~is_output
    mask[on_device(row_of[in_prompt]), on_device(tokens[in_prompt])] = True
    return counts, mask
