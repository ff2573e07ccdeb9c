"""The sampler: one token per row from ``[num_reqs, vocab]`` logits, vectorized over the batch.

Order per step (as vLLM v1): logprobs of the raw logits (the model's distribution) for rows that
asked; penalties; EOS and stop token ids set to ``-inf`` in rows with fewer than ``min_tokens``
outputs; greedy rows take the argmax; the others divide by temperature, then min-p, top-k, top-p,
and draw one token by inverse CDF from a single uniform per row. A seeded row's uniform comes
from ``sampling_random`` (a hash of seed and output length), the others' from torch's generator;
one number per row, not per vocabulary entry, keeps the draw cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember_scheduler.outputs import Logprobs
from ember_scheduler.sampling_params import GREEDY_TEMPERATURE
from ember_worker.sampling_metadata import SamplingMetadata
from ember_worker.sampling_ops import (
    apply_min_p_,
    apply_min_tokens_mask,
    apply_penalties,
    argmax_rows,
    inverse_cdf_sample,
    softmax_weights,
    to_float32,
    top_k_top_p_candidates,
)
from ember_worker.sampling_random import seeded_uniform

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata"]


@dataclass
class SamplerOutput:
    """Sampled token per row, and logprobs of the rows that asked for them.

    ``logprobs`` row ``i`` belongs to batch row ``logprobs_rows[i]``.
    """

    sampled_token_ids: torch.Tensor  # int64 [num_reqs]
    logprobs: Logprobs | None
    logprobs_rows: list[int]


class Sampler:
    """Samples one token per row under each row's sampling parameters."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(
                f"logits must be [num_reqs={metadata.temperature.shape[0]}, vocab], "
                f"got {tuple(logits.shape)}"
            )
        if (
            metadata.all_greedy
            and metadata.no_penalties
            and metadata.min_tokens_mask is None
            and metadata.max_num_logprobs is None
        ):  # the argmax reads the model's dtype: no float32 copy of the logits
            return SamplerOutput(
                sampled_token_ids=argmax_rows(logits), logprobs=None, logprobs_rows=[]
            )
        logits = to_float32(logits)
        raw_logits = logits
        if not metadata.no_penalties:
            logits = apply_penalties(
                logits,
                metadata.output_token_counts,
                metadata.prompt_token_mask,
                metadata.presence_penalties,
                metadata.frequency_penalties,
                metadata.repetition_penalties,
            )
        if metadata.min_tokens_mask is not None:
            logits = apply_min_tokens_mask(logits, *metadata.min_tokens_mask)
        sampled = argmax_rows(logits) if metadata.all_greedy else self._sample(logits, metadata)

        logprobs, rows = None, []
        if metadata.max_num_logprobs is not None:
            rows = [i for i, n in enumerate(metadata.num_logprobs) if n >= 0]
            asked_logits, asked_tokens = raw_logits, sampled
            if len(rows) < len(sampled):
                index = torch.tensor(rows, device=logits.device)
                asked_logits, asked_tokens = raw_logits[index], sampled[index]
            logprobs = _logprobs_of(
                asked_logits, asked_tokens, [metadata.num_logprobs[i] for i in rows]
            )
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, logprobs_rows=rows)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        temperature = metadata.temperature
        greedy = temperature < GREEDY_TEMPERATURE
        greedy_ids = None if metadata.all_random else argmax_rows(logits)
        logits = logits / torch.where(greedy, 1.0, temperature)[:, None]
        if metadata.min_p is not None:
            logits = apply_min_p_(logits, metadata.min_p)
        uniform = torch.rand(logits.shape[0], dtype=torch.float64, device=logits.device)
        if metadata.has_seed is not None:
            seeded = metadata.has_seed
            uniform = torch.where(
                seeded, seeded_uniform(metadata.seeds, metadata.num_output_tokens), uniform
            )
        truncated = _rows_with_truncation(metadata)
        if truncated is None:
            random_ids = inverse_cdf_sample(softmax_weights(logits), uniform)
        elif bool(truncated.all()):
            random_ids = _draw_truncated(logits, metadata.top_k, metadata.top_p, uniform)
        else:
            # Rows without top-k/top-p draw from the whole vocabulary; only the others rank
            # candidates, so one plain row never makes the batch sort its whole vocabulary.
            random_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            plain = ~truncated
            random_ids[plain] = inverse_cdf_sample(softmax_weights(logits[plain]), uniform[plain])
            random_ids[truncated] = _draw_truncated(
                logits[truncated],
                None if metadata.top_k is None else metadata.top_k[truncated],
                None if metadata.top_p is None else metadata.top_p[truncated],
                uniform[truncated],
            )
        if greedy_ids is None:
            return random_ids
        return torch.where(greedy, greedy_ids, random_ids)

    @staticmethod
    def compute_prompt_logprobs(
        logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int
    ) -> Logprobs:
        """Logprobs of each prompt position's next token (``target_token_ids``) plus the
        top ``num_logprobs`` alternatives, from ``[n, vocab]`` logits."""
        if logits.dim() != 2 or target_token_ids.shape != (logits.shape[0],):
            raise ValueError(
                f"target_token_ids must be [n] for logits [n, vocab], got "
                f"{tuple(target_token_ids.shape)} and {tuple(logits.shape)}"
            )
        if num_logprobs < 0:
            raise ValueError(f"num_logprobs must be non-negative, got {num_logprobs}")
        n = logits.shape[0]
        return _logprobs_of(logits.to(torch.float32), target_token_ids, [num_logprobs] * n)


def _draw_truncated(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    uniform: torch.Tensor,
) -> torch.Tensor:
    values, candidate_ids = top_k_top_p_candidates(logits, top_k, top_p)
    choice = inverse_cdf_sample(softmax_weights(values), uniform)
    if candidate_ids is None:
        return choice
    return candidate_ids.gather(1, choice[:, None])[:, 0]


def _rows_with_truncation(metadata: SamplingMetadata) -> torch.Tensor | None:
    """Bool mask of rows with a top-k or a top-p below 1, or None when there are none."""
    rows = None
    if metadata.top_k is not None:
        rows = metadata.top_k > 0
    if metadata.top_p is not None:
        rows = metadata.top_p < 1.0 if rows is None else rows | (metadata.top_p < 1.0)
    if rows is None or not bool(rows.any()):
        return None
    return rows


def _logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, num_logprobs: list[int]) -> Logprobs:
    """Chosen token, its rank and the top-N alternatives per row, N varying by row."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = chosen.to(torch.int64)
    chosen_logprobs = logprobs.gather(1, chosen[:, None])
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    top_n = max(num_logprobs, default=0)
    top_values, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    token_ids = torch.cat([chosen[:, None], top_ids], 1) if top_n else chosen[:, None]
    values = torch.cat([chosen_logprobs, top_values], 1) if top_n else chosen_logprobs
    ids_rows, value_rows = token_ids.tolist(), values.tolist()
    return Logprobs(
        token_ids=[row[: 1 + k] for row, k in zip(ids_rows, num_logprobs)],
        logprobs=[row[: 1 + k] for row, k in zip(value_rows, num_logprobs)],
        ranks=ranks.tolist(),
    )
