"""Paged attention in vectorized torch: the CPU path.

One call serves a whole batch without a Python loop over sequences: the batch is split into
decode sequences (one new token) and the rest (prefill or chunked prefill); each group gathers the
KV pages of all its sequences with one ``index_select`` into a reused workspace buffer and runs one
masked ``scaled_dot_product_attention``. Grouped-query
attention folds the query heads that share a KV head into the query-row dimension, so keys and
values are never repeated per query head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_kernels.torch_ops.workspace import WORKSPACE
from ember_kernels.validation import check_paged_attention_args


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged KV (see ``ember_kernels``).

    ``max_query_len`` and ``max_seq_len`` are accepted for signature parity with the Triton path;
    on the CPU reading the lengths costs no device sync, so they are not needed.
    """
    check_paged_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, sliding_window, out
    )
    if out is None:
        out = torch.empty_like(query)
    q_starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - q_starts
    seq_lens = seq_lens.long()
    if bool((q_lens > seq_lens).any()):
        raise ValueError("seq_lens: every sequence's KV length must cover its query tokens")
    attend = _Attention(query, key_cache, value_cache, scale, sliding_window, soft_cap)
    is_decode = q_lens == 1
    if bool(is_decode.all()):
        attend.decode(block_table, q_starts, seq_lens, out)
        return out
    is_prefill = q_lens > 1
    if bool(is_decode.any()):
        attend.decode(block_table[is_decode], q_starts[is_decode], seq_lens[is_decode], out)
    if bool(is_prefill.any()):
        attend.prefill(
            block_table[is_prefill],
            q_starts[is_prefill],
            q_lens[is_prefill],
            seq_lens[is_prefill],
            out,
        )
    return out


class _Attention:
    """The per-call constants shared by the decode and prefill groups."""

    def __init__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
    ) -> None:
        self.query = query
        # Half-precision inputs are attended in float32 (fp32 accumulation, as on the GPU).
        self.compute_dtype = torch.float32 if query.element_size() < 4 else query.dtype
        self.block_size = key_cache.shape[1]
        self.num_kv_heads = key_cache.shape[2]
        self.group = query.shape[1] // self.num_kv_heads
        self.head_size = query.shape[2]
        self.key_cache = key_cache
        self.value_cache = value_cache
        self.page_numel = key_cache[0].numel()
        self.scale = scale
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap

    def decode(
        self,
        block_table: torch.Tensor,
        q_starts: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        num_seqs, head_size = q_starts.shape[0], self.query.shape[2]
        if num_seqs == 0:
            return
        keys, values, positions = self._gather(block_table, seq_lens, int(seq_lens.max()))
        q = self.query[q_starts].to(self.compute_dtype)
        q = q.view(num_seqs, self.num_kv_heads, self.group, head_size)
        last = (seq_lens - 1)[:, None]
        mask = self._visible(positions, last)[:, None, None, :]
        o = self._softmax_attention(q, keys, values, mask)
        out[q_starts] = o.reshape(num_seqs, -1, head_size).to(out.dtype)

    def prefill(
        self,
        block_table: torch.Tensor,
        q_starts: torch.Tensor,
        q_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        num_seqs, head_size = q_starts.shape[0], self.query.shape[2]
        max_q = int(q_lens.max())
        keys, values, positions = self._gather(block_table, seq_lens, int(seq_lens.max()))
        rows = torch.arange(max_q)
        row_in_seq = torch.minimum(rows[None, :], (q_lens - 1)[:, None])  # pad rows repeat the last
        tokens = q_starts[:, None] + row_in_seq  # [num_seqs, max_q]
        q = self.query[tokens].to(self.compute_dtype)  # [num_seqs, max_q, q_heads, head]
        q = q.view(num_seqs, max_q, self.num_kv_heads, self.group, head_size)
        q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, self.num_kv_heads, -1, head_size)
        query_pos = (seq_lens - q_lens)[:, None] + row_in_seq  # [num_seqs, max_q]
        mask = self._visible(positions[:, None, :], query_pos[:, :, None])  # [seqs, max_q, kv]
        mask = mask[:, None, None].expand(-1, 1, self.group, -1, -1)
        mask = mask.reshape(num_seqs, 1, self.group * max_q, -1)
        o = self._softmax_attention(q, keys, values, mask)
        o = o.view(num_seqs, self.num_kv_heads, self.group, max_q, head_size)
        o = o.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_q, -1, head_size)
        is_real = rows[None, :] < q_lens[:, None]
        out[tokens[is_real]] = o[is_real].to(out.dtype)

    def _gather(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values ``[seqs, kv_heads, padded_len, head]`` and their positions.

        Whole pages are gathered into reused workspace buffers. Page slots past a sequence's
        pages read its first page again (real data, masked out later), so unused block table
        entries are never read; slots that may never have been written (past the sequence's
        length in its last page) are zeroed, so that stale or NaN cache contents cannot leak
        through a zero attention weight.
        """
        num_seqs, block_size = seq_lens.shape[0], self.block_size
        num_pages = -(-kv_len // block_size)
        padded_len = num_pages * block_size
        seq_pages = (seq_lens + block_size - 1) // block_size
        page = torch.arange(num_pages).expand(num_seqs, -1)
        page = torch.where(page < seq_pages[:, None], page, 0)
        blocks = block_table[:, :num_pages].long().gather(1, page).view(-1)
        pages_shape = (num_seqs, num_pages, block_size, self.num_kv_heads, self.head_size)
        attend_shape = (num_seqs, self.num_kv_heads, padded_len, self.head_size)
        positions = torch.arange(padded_len).expand(num_seqs, -1)
        # A short sequence (one partial page) repeats that partial page; longer ones repeat
        # their full first page, so only their last page's tail can hold unwritten slots.
        unwritten = (positions >= seq_lens[:, None]) & (
            (positions < (seq_pages * block_size)[:, None]) | (seq_lens < block_size)[:, None]
        )
        any_unwritten = bool(unwritten.any())
        gathered = []
        for name, cache in (("keys", self.key_cache), ("values", self.value_cache)):
            pages = WORKSPACE.get(
                f"{name}_pages", blocks.numel() * self.page_numel, cache.dtype, cache.device
            )
            torch.index_select(cache, 0, blocks, out=pages.view(-1, *cache.shape[1:]))
            # SDPA is several times faster on [seqs, kv_heads, len, head] contiguous memory than
            # on a transposed view: one more copy (converting half precision on the way) pays.
            out = WORKSPACE.get(name, pages.numel(), self.compute_dtype, cache.device)
            out = out.view(attend_shape)
            out.view(num_seqs, self.num_kv_heads, num_pages, block_size, -1).copy_(
                pages.view(pages_shape).permute(0, 3, 1, 2, 4)
            )
            if any_unwritten:
                out.transpose(1, 2)[unwritten] = 0
            gathered.append(out)
        return gathered[0], gathered[1], positions

    def _visible(self, key_pos: torch.Tensor, query_pos: torch.Tensor) -> torch.Tensor:
        """Causal (and sliding-window) visibility of key positions from query positions."""
        visible = key_pos <= query_pos
        if self.sliding_window is not None:
            visible &= key_pos > query_pos - self.sliding_window
        return visible

    def _softmax_attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        if self.soft_cap is None:
            # An additive float mask takes a faster SDPA path on the CPU than a boolean one.
            bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=self.scale)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = torch.tanh(scores / self.soft_cap) * self.soft_cap
        scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values)
