"""Batched logits transforms and the draw of the sampler.

Each works on ``[num_reqs, vocab]`` float32 logits with one parameter per row and leaves rows
whose parameter is neutral unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from ember_kernels import cpu_ops

_NEG_INF = float("-inf")
# bfloat16 logits up to this many entries (a decode step's few rows of a large vocabulary) widen
# to float32 in numpy on the calling thread: torch's conversion of them splits across its threads,
# and waking those costs more than the conversion (many times more when the cores are busy).
_SERIAL_WIDEN_MAX = 1 << 20


def apply_penalties(
    logits: torch.Tensor,
    output_token_counts: torch.Tensor,
    prompt_token_mask: torch.Tensor | None,
    presence_penalties: torch.Tensor | None,
    frequency_penalties: torch.Tensor | None,
    repetition_penalties: torch.Tensor | None,
) -> torch.Tensor:
    """vLLM's penalties, into a new tensor (``None``: no row uses that penalty).

    Repetition (over prompt and output tokens): a seen token's positive logit is divided by the
    penalty, a negative one multiplied. Then frequency and presence (over output tokens only):
    subtract ``frequency × count`` and ``presence × [count > 0]``.
    """
    if repetition_penalties is not None:
        seen = output_token_counts > 0
        seen |= prompt_token_mask
        rep = repetition_penalties[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    penalty = None
    if frequency_penalties is not None:
        penalty = frequency_penalties[:, None] * output_token_counts
    if presence_penalties is not None:
        presence = presence_penalties[:, None] * (output_token_counts > 0)
        penalty = presence if penalty is None else penalty.add_(presence)
    return logits if penalty is None else logits - penalty


def apply_min_tokens_mask(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """A copy of ``logits`` with ``logits[rows[i], token_ids[i]]`` set to ``-inf`` (EOS and stop
    ids of rows that have not reached min_tokens); the input, whose raw values logprobs read,
    is left as it was."""
    return logits.index_put((rows, token_ids), torch.tensor(_NEG_INF, device=logits.device))


def apply_min_p_(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (in place) tokens whose probability is below ``min_p`` times the row's top one."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's candidate tokens after top-k and top-p, dropped ones set to ``-inf``.

    Keeps the ``top_k`` largest logits (0: all), then the smallest run of the most likely of
    those whose probability (renormalized after top-k) reaches ``top_p``, at least one token.
    Returns ``(values, token_ids)``: when few candidates can survive, ``[n, C]`` in descending
    order with their token ids (``topk`` of ``C`` = the largest ``top_k``, or for a top-p-only
    row the tokens above ``(1 - top_p) / vocab``: those below always fall in the dropped tail,
    which can hold ``vocab`` of them); otherwise the logits themselves, masked in vocabulary
    order, with ``token_ids`` None (a threshold per row from sorted values, no index sort).
    """
    vocab = logits.shape[-1]
    full = torch.full((logits.shape[0],), vocab, dtype=torch.int64, device=logits.device)
    k = full if top_k is None else torch.where(top_k > 0, top_k.clamp(max=vocab), vocab).long()
    has_k = k < vocab
    needed = k
    log_norm = None
    if top_p is not None:
        log_norm = logits.logsumexp(dim=-1)
        # A little below the bound, so rounding never leaves out a token that could be kept.
        floor = torch.log((1.0 - top_p).clamp(min=0.0) / vocab) - 1e-3
        above = (logits > (log_norm + floor)[:, None]).sum(dim=-1)
        needed = torch.where(has_k, k, above)
    width = int(needed.max())
    if width > vocab // 8:
        return _mask_below_threshold(logits, k, top_p), None
    values, token_ids = logits.topk(width, dim=-1)
    rank = torch.arange(width, device=logits.device)
    values.masked_fill_(rank[None, :] >= k[:, None], _NEG_INF)
    if top_p is not None:
        # Probabilities after top-k: over the top-k for rows that have one, else the full row.
        norm = torch.where(has_k, values.logsumexp(dim=-1), log_norm)
        probs = (values - norm[:, None]).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        drop = mass_before >= _top_p_limit(top_p)[:, None]
        drop[:, 0] = False
        values.masked_fill_(drop, _NEG_INF)
    return values, token_ids


def _top_p_limit(top_p: torch.Tensor) -> torch.Tensor:
    return torch.where(top_p >= 1.0, float("inf"), top_p)


def _mask_below_threshold(
    logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Top-k/top-p over whole rows: find each row's smallest kept logit from the sorted values
    and mask the logits below it (tokens tied with it are kept)."""
    vocab = logits.shape[-1]
    if logits.device.type == "cpu":  # numpy's vectorized sort of values is far faster here
        ascending = torch.from_numpy(np.sort(logits.numpy(), axis=-1))
    else:
        ascending = logits.sort(dim=-1).values
    first_kept = vocab - k  # in ascending order
    if top_p is not None:
        position = torch.arange(vocab, device=logits.device)
        ascending.masked_fill_(position[None, :] < first_kept[:, None], _NEG_INF)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        mass_above = cumulative[:, -1:] - cumulative  # of the strictly more likely tokens
        # at least top-k's cut: a row without top-p (limit inf) would otherwise count none
        first_kept = torch.maximum(
            first_kept, (mass_above >= _top_p_limit(top_p)[:, None]).sum(dim=-1)
        )
        first_kept = first_kept.clamp(max=vocab - 1)
    threshold = ascending.gather(1, first_kept[:, None])
    return logits.masked_fill(logits < threshold, _NEG_INF)


def inverse_cdf_sample(
    weights: torch.Tensor, uniform: torch.Tensor, chunk: int = 256
) -> torch.Tensor:
    """Index drawn from each row of non-negative ``weights`` (any scale) by its uniform in [0, 1).

    Two levels, to avoid a cumulative sum over the whole vocabulary: pick a chunk of ``chunk``
    entries by the cumulative sum of chunk totals, then an entry by the cumulative sum inside
    that chunk, rescaled to it. Cumulative sums are float64; zero-weight entries are never
    chosen.
    """
    n, width = weights.shape
    chunk = min(chunk, width)
    if width % chunk:
        weights = torch.nn.functional.pad(weights, (0, chunk - width % chunk))
    chunks = weights.view(n, -1, chunk)
    chunk_cum = chunks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)
    target = uniform.to(torch.float64) * chunk_cum[:, -1]
    picked = torch.searchsorted(chunk_cum, target[:, None], right=True)
    end = chunk_cum.gather(1, picked)[:, 0]
    start = torch.where(picked[:, 0] > 0, chunk_cum.gather(1, (picked - 1).clamp(min=0))[:, 0], 0.0)
    fraction = ((target - start) / (end - start)).clamp(max=1.0 - 2.0**-40)
    rows = torch.arange(n, device=weights.device)
    inside = chunks[rows, picked[:, 0]].to(torch.float64).cumsum(dim=-1)
    offset = torch.searchsorted(inside, (fraction * inside[:, -1])[:, None], right=True)
    return (picked * chunk + offset)[:, 0]


def softmax_weights(logits: torch.Tensor) -> torch.Tensor:
    """``exp(logits - row max)``: softmax without the normalization the draw does not need."""
    return (logits - logits.amax(dim=-1, keepdim=True)).exp_()


def to_float32(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as float32 (the same tensor if it is float32 already). Contiguous bfloat16 on
    the CPU up to ``_SERIAL_WIDEN_MAX`` entries widens in numpy: a bfloat16 is the top half of
    the float32 of the same value, so the widening is exact, as torch's is."""
    if logits.dtype == torch.float32:
        return logits
    if (
        logits.dtype != torch.bfloat16
        or logits.device.type != "cpu"
        or logits.numel() > _SERIAL_WIDEN_MAX
        or not logits.is_contiguous()
    ):
        return logits.to(torch.float32)
    wide = logits.detach().view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    wide <<= 16
    return torch.from_numpy(wide.view(np.float32))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per-row argmax (int64): the first index of each row's largest value. On CPU, float32 and
    bfloat16 logits go to the compiled kernel (``cpu_ops.argmax_rows``: bfloat16 read in place,
    rows split between the threads) where it is built, else to numpy's SIMD argmax (many times
    faster than torch's) on float32."""
    if logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    if logits.dtype in (torch.float32, torch.bfloat16) and cpu_ops.available():
        return cpu_ops.argmax_rows(logits.detach()).view(logits.shape[:-1])
    return torch.from_numpy(np.argmax(to_float32(logits).detach().numpy(), axis=-1))
