"""Paged attention in vectorized torch: the CPU path.

One call serves a whole batch without a Python loop over sequences or tokens. The batch is split
into decode sequences (one new token) and the rest (prefill or chunked prefill). Each group
gathers the KV pages of all its sequences with one ``index_select`` into reused workspace
buffers and runs one masked ``scaled_dot_product_attention`` on a head-major view of them (no
second copy in float32). The query heads that share a KV head are folded into the query rows, so
keys and values are never repeated per query head.

Groups whose gathered KV would exceed ``CHUNK_BYTES`` are cut into chunks of sequences (shortest
first, so each chunk pads only to its own longest), so that the gathered pages are still in the
CPU's cache when they are attended (a loop over chunks of several megabytes each, never over
tokens). Everything that depends only on the batch's lengths and block table (the groups,
chunks, pages to gather, masks) is a ``_BatchPlan``. Every layer of a forward step passes the
same metadata, so the last plan is kept and reused while the metadata is equal: only the first
layer of a step pays for it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

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
    plan = _plan_for(query, key_cache, block_table, query_start_loc, seq_lens, sliding_window)
    for group in plan.groups:
        _attend(group, plan, query, key_cache, value_cache, scale, soft_cap, out)
    return out


@dataclass
class _GroupPlan:
    """One group's gather and mask: decode sequences, or prefill/chunked-prefill sequences."""

    num_seqs: int
    num_pages: int
    max_q: int
    blocks: torch.Tensor  # [num_seqs * num_pages] physical blocks to gather, page by page
    unwritten: torch.Tensor | None  # seq * padded_len + position of each slot to zero
    visible: torch.Tensor  # [num_seqs, 1, group * max_q, padded_len] bool
    bias: torch.Tensor  # the same as an additive float mask (0 or -inf)
    rows: torch.Tensor  # [num_seqs * max_q] query row of each (sequence, new token); pads repeat
    real: torch.Tensor | None  # positions in ``rows`` of the real tokens (None: all are real)
    out_rows: torch.Tensor  # the query rows of the real tokens: where the output goes


@dataclass
class _BatchPlan:
    groups: list[_GroupPlan]
    compute_dtype: torch.dtype
    settings: tuple  # block size, heads per KV head, window, compute dtype, bytes per position
    metadata: tuple[torch.Tensor, ...]  # copies of block_table, query_start_loc, seq_lens


_LAST_PLAN = threading.local()
# Gathered keys and values per chunk of sequences: small enough that the gathered pages are still
# in the CPU's cache when they are attended (measured: up to 2x faster than one
# chunk for 64 sequences x 1k tokens); batches with less KV than this are a single chunk.
CHUNK_BYTES = 4 * 2**20


def _plan_for(query, key_cache, block_table, query_start_loc, seq_lens, sliding_window):
    """The plan of this batch: the last one if it was built from equal metadata, else a new one.

    Equality is checked by content (a few small ``torch.equal``), not identity, so a caller that
    rewrites its metadata buffers in place (even through a numpy view) is never served a stale
    plan.
    """
    block_size, group = key_cache.shape[1], query.shape[1] // key_cache.shape[2]
    compute_dtype = torch.float32 if query.element_size() < 4 else query.dtype
    # Bytes of gathered keys and values per KV position.
    token_bytes = 2 * key_cache.shape[2] * key_cache.shape[3] * compute_dtype.itemsize
    settings = (block_size, group, sliding_window, compute_dtype, token_bytes)
    metadata = (block_table, query_start_loc, seq_lens)
    plan = getattr(_LAST_PLAN, "plan", None)
    if (
        plan is not None
        and plan.settings == settings
        and all(torch.equal(a, b) for a, b in zip(plan.metadata, metadata))
    ):
        return plan
    groups = _build_groups(
        block_table,
        query_start_loc,
        seq_lens,
        block_size,
        group,
        sliding_window,
        compute_dtype,
        token_bytes,
    )
    plan = _BatchPlan(groups, compute_dtype, settings, tuple(t.clone() for t in metadata))
    _LAST_PLAN.plan = plan
    return plan


def _build_groups(
    block_table,
    query_start_loc,
    seq_lens,
    block_size,
    group,
    sliding_window,
    compute_dtype,
    token_bytes,
) -> list[_GroupPlan]:
    """The decode sequences and the others, each cut into chunks of about ``CHUNK_BYTES``."""
    q_starts = query_start_loc[:-1].long()
    q_lens = query_start_loc[1:].long() - q_starts
    seq_lens = seq_lens.long()
    if bool((q_lens > seq_lens).any()):
        raise ValueError("seq_lens: every sequence's KV length must cover its query tokens")
    is_decode = q_lens == 1
    if bool(is_decode.all()):
        selections = [torch.arange(seq_lens.shape[0])]
    else:
        selections = [s.nonzero()[:, 0] for s in (is_decode, q_lens > 1) if bool(s.any())]
    plans = []
    for seqs in selections:
        # Shortest first, so that each chunk pads only to its own longest sequence.
        seqs = seqs[seq_lens[seqs].argsort(stable=True)]
        padded_len = -(-int(seq_lens[seqs].max()) // block_size) * block_size
        chunk = max(1, CHUNK_BYTES // (padded_len * token_bytes))
        for start in range(0, seqs.shape[0], chunk):
            part = seqs[start : start + chunk]
            plans.append(
                _build_group(
                    block_table[part],
                    q_starts[part],
                    q_lens[part],
                    seq_lens[part],
                    block_size,
                    group,
                    sliding_window,
                    compute_dtype,
                )
            )
    return plans


def _build_group(
    block_table, q_starts, q_lens, seq_lens, block_size, group, sliding_window, compute_dtype
) -> _GroupPlan:
    num_seqs = seq_lens.shape[0]
    max_q = int(q_lens.max())
    num_pages = -(-int(seq_lens.max()) // block_size)
    padded_len = num_pages * block_size
    # Page slots past a sequence's pages read its first page again (real data, masked out), so
    # block table entries past a sequence's pages are never read.
    seq_pages = (seq_lens + block_size - 1) // block_size
    page = torch.arange(num_pages).expand(num_seqs, -1)
    page = torch.where(page < seq_pages[:, None], page, 0)
    blocks = block_table[:, :num_pages].long().gather(1, page).view(-1)
    # Slots that may never have been written: past the length in a sequence's last page (and,
    # for a sequence shorter than one page, in every repeat of that page). They are zeroed after
    # the gather so that stale or NaN cache contents cannot leak through a zero weight.
    positions = torch.arange(padded_len).expand(num_seqs, -1)
    unwritten = (positions >= seq_lens[:, None]) & (
        (positions < (seq_pages * block_size)[:, None]) | (seq_lens < block_size)[:, None]
    )
    token = torch.arange(max_q)
    token_in_seq = torch.minimum(token[None, :], (q_lens - 1)[:, None])  # pads repeat the last
    rows = q_starts[:, None] + token_in_seq  # [num_seqs, max_q]
    query_pos = (seq_lens - q_lens)[:, None] + token_in_seq
    visible = positions[:, None, :] <= query_pos[:, :, None]  # [num_seqs, max_q, padded_len]
    if sliding_window is not None:
        visible &= positions[:, None, :] > query_pos[:, :, None] - sliding_window
    # Rows are ordered (query head within the group, token), matching the folded queries.
    visible = visible[:, None, None].expand(-1, 1, group, -1, -1)
    visible = visible.reshape(num_seqs, 1, group * max_q, padded_len)
    bias = torch.zeros(visible.shape, dtype=compute_dtype).masked_fill_(~visible, float("-inf"))
    rows = rows.view(-1)
    real = None if max_q == 1 else (token[None, :] < q_lens[:, None]).view(-1).nonzero()[:, 0]
    return _GroupPlan(
        num_seqs=num_seqs,
        num_pages=num_pages,
        max_q=max_q,
        blocks=blocks,
        unwritten=unwritten.view(-1).nonzero()[:, 0] if bool(unwritten.any()) else None,
        visible=visible,
        bias=bias,
        rows=rows,
        real=real,
        out_rows=rows if real is None else rows[real],
    )


def _attend(group, plan, query, key_cache, value_cache, scale, soft_cap, out) -> None:
    num_seqs, max_q = group.num_seqs, group.max_q
    head_size, num_kv_heads = query.shape[2], key_cache.shape[2]
    compute_dtype = plan.compute_dtype
    keys = _gather(group, key_cache, "keys", compute_dtype)
    values = _gather(group, value_cache, "values", compute_dtype)
    q = query[group.rows].to(compute_dtype)  # [num_seqs * max_q, q_heads, head]
    q = q.view(num_seqs, max_q, num_kv_heads, -1, head_size)
    # -> [num_seqs, kv_heads, group * max_q, head]; for decode (max_q == 1) a free view.
    q = q.permute(0, 2, 3, 1, 4).reshape(num_seqs, num_kv_heads, -1, head_size)
    if soft_cap is None:
        # An additive float mask takes a faster SDPA path on the CPU than a boolean one.
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=group.bias, scale=scale)
    else:
        scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / soft_cap) * soft_cap
        scores = scores.masked_fill(~group.visible, float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), values)
    o = o.view(num_seqs, num_kv_heads, -1, max_q, head_size).permute(0, 3, 1, 2, 4)
    o = o.reshape(num_seqs * max_q, -1, head_size)
    if group.real is not None:
        o = o[group.real]
    out[group.out_rows] = o.to(out.dtype)


def _gather(
    group: _GroupPlan, cache: torch.Tensor, name: str, compute_dtype: torch.dtype
) -> torch.Tensor:
    """The group's pages of ``cache`` as ``[num_seqs, kv_heads, padded_len, head]``.

    The pages are copied once, whole, by ``index_select``; in the compute dtype the result is a
    transposed view of that copy (SDPA reads the strides as they are, measured faster than a second
    copy into head-major order), otherwise one more copy converts it.
    """
    num_kv_heads, head_size = cache.shape[2:]
    pages = WORKSPACE.get(name, group.blocks.numel() * cache[0].numel(), cache.dtype, cache.device)
    torch.index_select(cache, 0, group.blocks, out=pages.view(-1, *cache.shape[1:]))
    if group.unwritten is not None:
        pages.view(-1, num_kv_heads * head_size).index_fill_(0, group.unwritten, 0)
    gathered = pages.view(group.num_seqs, -1, num_kv_heads, head_size).transpose(1, 2)
    if cache.dtype == compute_dtype:
        return gathered
    converted = WORKSPACE.get(f"{name}_converted", pages.numel(), compute_dtype, cache.device)
    return converted.view(gathered.shape).copy_(gathered)
