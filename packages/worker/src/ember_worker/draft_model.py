"""A draft model: a smaller model with the target's vocabulary proposing k tokens per step.

It shares the target's block table (same block ids, same slots) but has its own KV tensors, sized
to its own layers. Each step it first runs over exactly the tokens the target ran over (so its
KV covers every token the target's does, prefill chunks included, and anything rejected is
overwritten when recomputed), then decodes k tokens autoregressively from each proposing row's
last token, one forward per draft position. The slots past the scheduled tokens are the
scheduler's lookahead (``num_lookahead_tokens = k``). Drafts are drawn from the draft's own
processed distribution (the request's temperature, top-k, top-p, min-p; argmax when greedy),
which the rejection sampler is given as ``q``.
"""

from __future__ import annotations

import numpy as np
import torch

from ember_spec_decode import Proposal, SpeculativeConfig
from ember_worker.input_batch import InputBatch
from ember_worker.kv_cache import KVCacheSpec, allocate_kv_cache
from ember_worker.layers.attention import AttentionMetadata, bind_kv_cache
from ember_worker.model_loader import LoadedModel, load_model
from ember_worker.sampling_ops import inverse_cdf_sample
from ember_worker.spec_sampling import DRAFT_STREAM, processed_probs, uniforms


class DraftModelProposer:
    """Loads the draft model and proposes drafts with it; keeps each row's draft
    distributions until the target verifies them."""

    def __init__(
        self, config: SpeculativeConfig, target: LoadedModel, batch: InputBatch, device
    ) -> None:
        loaded = load_model(config.model, dtype=target.dtype, device=device, pack_weights=True)
        vocab, target_vocab = loaded.config.vocab_size, target.config.vocab_size
        if vocab != target_vocab:
            raise ValueError(
                f"speculative_config.model {config.model!r} has a vocabulary of {vocab} tokens; "
                f"the target's has {target_vocab}: a draft model must share the target's"
            )
        if loaded.config.max_position_embeddings < batch.max_model_len:
            raise ValueError(
                f"speculative_config.model {config.model!r} holds "
                f"{loaded.config.max_position_embeddings} positions, fewer than max_model_len "
                f"({batch.max_model_len})"
            )
        self.model = loaded.model
        self.batch = batch
        self.num_speculative_tokens = config.num_speculative_tokens
        self.kv_cache_spec = KVCacheSpec.for_model(loaded, batch.block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Draft distributions of each request's pending drafts, [num_drafts, vocab].
        self.draft_probs: dict[str, torch.Tensor] = {}

    def initialize_kv_cache(self, num_blocks: int, device: torch.device) -> None:
        self.kv_caches = allocate_kv_cache(self.kv_cache_spec, num_blocks, device)
        bind_kv_cache(self.model, self.kv_caches)

    def catch_up(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """Write the draft's KV for the tokens the target just ran over."""
        self.model(input_ids, positions, metadata)

    def take_draft_probs(self, rows: np.ndarray, num_drafts: np.ndarray) -> torch.Tensor:
        """The draft distributions of this step's drafts, ``num_drafts[i]`` for ``rows[i]``,
        flat in row order (``[sum(num_drafts), vocab]``), as ``rejection_sample`` takes them."""
        req_ids = self.batch.req_ids
        return torch.cat(
            [self.draft_probs[req_ids[row]][:count] for row, count in zip(rows, num_drafts)]
        )

    def propose(self, rows: np.ndarray) -> Proposal:
        """k drafts for each of ``rows`` (rows that just got a token), decoded from the row's
        last token at its position."""
        batch = self.batch
        n, k = batch.num_reqs, self.num_speculative_tokens
        drafts = np.zeros((n, k), dtype=np.int32)
        counts = np.zeros(n, dtype=np.int32)
        alive = set(batch.req_ids)
        self.draft_probs = {r: p for r, p in self.draft_probs.items() if r in alive}
        if rows.size == 0:
            return Proposal(drafts, counts)
        state = batch.rows[rows]
        last = batch.num_tokens_no_spec[rows].astype(np.int64) - 1
        # Only into slots the row's blocks hold (the scheduler's lookahead stops at the context
        # limit), and short of max_model_len, where the scheduler would cut the drafts anyway.
        room = np.minimum(
            batch.num_blocks[rows].astype(np.int64) * batch.block_size - last,
            batch.max_model_len - 1 - last,
        )
        count = np.minimum(k, room).clip(min=0)
        device = next(self.model.parameters()).device
        tokens = torch.from_numpy(batch.token_ids_cpu[rows, last].astype(np.int64))
        draw = uniforms(state, np.arange(k)[None, :].repeat(len(rows), 0), DRAFT_STREAM)
        probs = torch.zeros((len(rows), k, batch.vocab_size), device=device)
        active = np.arange(len(rows))
        for j in range(k):
            active = active[count[active] > j]
            if active.size == 0:
                break
            metadata, positions = self._decode_metadata(rows[active], last[active] + j, device)
            hidden = self.model(tokens[active].to(device), positions, metadata)
            q = processed_probs(self.model.compute_logits(hidden), state[active])
            chosen = inverse_cdf_sample(q, draw[active, j].to(device)).cpu()
            tokens[active] = chosen
            drafts[rows[active], j] = chosen.numpy()
            probs[active, j] = q
        counts[rows] = count
        for i, row in enumerate(rows.tolist()):
            if count[i]:
                self.draft_probs[batch.req_ids[row]] = probs[i, : count[i]]
        return Proposal(drafts, counts)

    def _decode_metadata(
        self, rows: np.ndarray, positions: np.ndarray, device
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Attention metadata for one token per row at ``positions``."""
        batch = self.batch
        size = batch.block_size
        blocks = batch.block_table_cpu[rows, positions // size].astype(np.int64)
        slots = blocks * size + positions % size
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            block_table=torch.from_numpy(batch.block_table_cpu[rows]).to(device),
            query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
            seq_lens=torch.from_numpy((positions + 1).astype(np.int32)).to(device),
            max_query_len=1,
            max_seq_len=int(positions.max()) + 1,
        )
        return metadata, torch.from_numpy(positions).to(device)
