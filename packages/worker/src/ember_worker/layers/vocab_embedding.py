"""Token embedding and LM head split over the vocabulary, as vLLM's VocabParallelEmbedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember_kernels.packed_linear import linear
from ember_worker.layers.linear import empty_weight
from ember_worker.layers.parallel import SINGLE_RANK, TensorParallelGroup


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows (token ids) are split in contiguous ranges across the group.

    The vocabulary is padded to a multiple of the group size; each rank looks up the ids in its
    range, zeroes the rest and the partial results are summed.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * per_rank
        self.vocab_end = min(self.vocab_start + per_rank, num_embeddings)
        self.weight = self._empty_table(per_rank, embedding_dim, dtype)

    def _empty_table(self, rows: int, dim: int, dtype: torch.dtype | None) -> nn.Parameter:
        """Row-major: a lookup reads whole rows."""
        return nn.Parameter(torch.empty(rows, dim, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1)
        return self.tp.all_reduce(out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(
                f"checkpoint embedding of shape {tuple(loaded.shape)} does not match "
                f"vocab_size {self.num_embeddings} x {param.shape[1]}"
            )
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary; each rank computes its slice of the logits.

    Its weight is stored input-major as the linear layers' (``empty_weight``); a head tied to the
    embedding takes the embedding's row-major table instead.
    """

    def _empty_table(self, rows: int, dim: int, dtype: torch.dtype | None) -> nn.Parameter:
        return empty_weight(rows, dim, dtype)

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        tp: TensorParallelGroup = SINGLE_RANK,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, tp=tp, dtype=dtype)
        self.register_parameter("weight_scale", None)  # the scales of an int8 weight

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(linear(hidden_states, self.weight, scales=self.weight_scale))
        return logits[..., : self.num_embeddings]
