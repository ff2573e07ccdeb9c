"""Pooling of prompt hidden states for pooling requests (embed, classify).

A pooling request's prompt may take several steps (chunked prefill). ``last`` pooling reads only
the final position; ``cls`` keeps the first position's hidden state and ``mean`` a running sum
between chunks. Each step gathers the pooled positions of every pooling row at once (one gather
for last and cls, one ``index_add_`` for the mean sums); only rows mid-prompt keep state.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ember_scheduler.pooling_params import POOLING_TYPES, PoolingParams
from ember_worker.input_batch import InputBatch

_LAST, _MEAN, _CLS = (POOLING_TYPES.index(t) for t in ("last", "mean", "cls"))


class Pooler:
    """The pooling requests of one model runner, and their partial pools between chunks.

    ``score_head`` is a classification model's ``score`` layer (None for a model without one:
    such a model takes no ``classify`` requests).
    """

    def __init__(self, hidden_size: int, score_head: nn.Module | None = None) -> None:
        self.hidden_size = hidden_size
        self.score_head = score_head
        self.params: dict[str, PoolingParams] = {}
        self._partial: dict[str, torch.Tensor] = {}  # cls: first hidden state; mean: running sum

    def add_request(self, req_id: str, params: PoolingParams) -> None:
        if params.task == "classify" and self.score_head is None:
            raise ValueError(
                f"request {req_id!r} asks to classify, but the model has no score head"
            )
        if params.dimensions is not None and params.dimensions > self.hidden_size:
            raise ValueError(
                f"PoolingParams.dimensions of {req_id!r} must be at most the hidden size "
                f"{self.hidden_size}, got {params.dimensions}"
            )
        self.params[req_id] = params
        self._partial.pop(req_id, None)  # a resumed (preempted) request starts over

    def remove_request(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self._partial.pop(req_id, None)

    def pool(
        self, hidden_states: torch.Tensor, batch: InputBatch, num_scheduled: np.ndarray
    ) -> dict[str, bytes]:
        """The pooled result (float32 little-endian bytes) of every pooling request whose prompt
        completes this step; others keep their partial pools."""
        index = batch.req_id_to_index
        req_ids = [r for r in self.params if num_scheduled[index[r]] > 0]
        if not req_ids:
            return {}
        rows = np.array([index[r] for r in req_ids], dtype=np.int64)
        counts = num_scheduled[rows].astype(np.int64)
        starts = (np.cumsum(num_scheduled, dtype=np.int64) - num_scheduled)[rows]
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        prompt_lens = batch.num_prompt_tokens[rows].astype(np.int64)
        done = computed + counts >= prompt_lens
        kinds = np.array(
            [POOLING_TYPES.index(self.params[r].pooling_type or "last") for r in req_ids]
        )

        device = hidden_states.device
        pooled = torch.zeros(len(req_ids), self.hidden_size, dtype=torch.float32, device=device)
        last = kinds == _LAST
        first = (kinds == _CLS) & (computed == 0)
        gather_rows = np.flatnonzero(last | first)
        if gather_rows.size:
            positions = np.where(last, starts + counts - 1, starts)[gather_rows]
            pooled[_index(gather_rows, device)] = hidden_states[_index(positions, device)].float()
        mean_rows = np.flatnonzero(kinds == _MEAN)
        if mean_rows.size:
            mean_counts = counts[mean_rows]
            segment = np.repeat(mean_rows, mean_counts)
            offsets = np.arange(segment.size) - np.repeat(np.cumsum(mean_counts) - mean_counts,
                                                          mean_counts)  # fmt: skip
            tokens = np.repeat(starts[mean_rows], mean_counts) + offsets
            pooled.index_add_(
                0, _index(segment, device), hidden_states[_index(tokens, device)].float()
            )

        # Rows with state from earlier chunks, or leaving some for later ones (chunked prompts).
        for i in np.flatnonzero((kinds != _LAST) & (~done | (computed > 0))).tolist():
            req_id = req_ids[i]
            earlier = self._partial.pop(req_id, None)
            if earlier is not None:
                if kinds[i] == _CLS:
                    pooled[i] = earlier
                else:
                    pooled[i] += earlier
            if not done[i]:
                self._partial[req_id] = pooled[i].clone()

        finished = np.flatnonzero(done)
        if finished.size == 0:
            return {}
        divisor = np.where(kinds == _MEAN, prompt_lens, 1)[finished]
        vectors = pooled[_index(finished, device)] / torch.from_numpy(divisor).to(device)[:, None]
        results = self._apply_heads([req_ids[i] for i in finished.tolist()], vectors)
        return {r: v.astype("<f4").tobytes() for r, v in results.items()}

    def _apply_heads(self, req_ids: list[str], vectors: torch.Tensor) -> dict[str, np.ndarray]:
        """Per request: the embedding (truncated to ``dimensions``, then normalized) or the
        class probabilities (the score head, then softmax, or sigmoid for one label)."""
        params = [self.params[r] for r in req_ids]
        classify = [i for i, p in enumerate(params) if p.task == "classify"]
        outputs: list[torch.Tensor | None] = [None] * len(req_ids)
        if classify:
            head = self.score_head
            weight = head.weight
            logits = head(vectors[classify].to(weight.dtype)).float()
            num_labels = logits.shape[-1]
            activated = logits.sigmoid() if num_labels == 1 else logits.softmax(-1)
            for row, i in enumerate(classify):
                outputs[i] = activated[row] if params[i].use_activation else logits[row]
        embed = [i for i, p in enumerate(params) if p.task == "embed"]
        if embed:
            normalized = torch.nn.functional.normalize(vectors[embed], dim=-1)
            for row, i in enumerate(embed):
                p = params[i]
                if p.dimensions is not None:
                    vector = vectors[i, : p.dimensions]
                    outputs[i] = (
                        torch.nn.functional.normalize(vector, dim=-1) if p.normalize else vector
                    )
                else:
                    outputs[i] = normalized[row] if p.normalize else vectors[i]
        return {r: out.cpu().numpy() for r, out in zip(req_ids, outputs)}


def _index(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)
