"""Compiled C++ kernels for CPU tensors (built on first use, see ``build``).

``available()`` says whether they could be built here (``start_background_build`` and
``one_step``: an engine that serves while they compile). Each function takes the same arguments as
the ``ember_kernels`` function of its name, for float32, float16 and bfloat16 tensors (``DTYPES``),
and raises ``RuntimeError`` where the kernels could not be built.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ember_kernels import cpu_features
from ember_kernels.cpu_ops.build import (
    building_in_background,
    building_now,
    load_library,
    settled_library,
)
from ember_kernels.cpu_ops.build import (
    start_background_build as start_background_build,
)
from ember_kernels.validation import check_paged_attention_args

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_told: list = [None]  # the library told this CPU's choices (packed_gemv_max_rows)
_step = threading.local()  # .depth: one_step blocks open; .available: their answer once asked


def available() -> bool:
    """Whether the compiled CPU kernels work here: the first call builds or loads them (waiting
    for a background build), except inside ``one_step``, which answers without waiting."""
    if not getattr(_step, "depth", 0):
        return load_library() is not None
    if _step.available is None:  # the step's first question: its answer for the whole step
        if building_in_background():
            _step.available = settled_library() is not None
        else:
            _step.available = load_library() is not None
    return _step.available


def available_or_building() -> bool:
    """Whether the compiled kernels are here or still being built in the background, without
    waiting for that build: for a choice made once at load that outlives the build (a weight
    layout the kernels read), so that a first start does not wait for the compiler. Until the
    build is done, steps run the torch path on that choice."""
    return building_now() or available()


@contextlib.contextmanager
def one_step():
    """Run a model step on one path: ``available()`` in this thread keeps, until the block ends,
    the answer it first gives in it, which in a process that started a background build is
    whether that build is done (a step never waits for it). A build finishing mid-step is
    taken up by the next step (its kernels and the decoder stack's), never by half of this one.
    Nothing is built or loaded unless the step asks (a GPU step does not)."""
    depth = getattr(_step, "depth", 0)
    if depth == 0:
        _step.available = None
    _step.depth = depth + 1
    try:
        yield
    finally:
        _step.depth = depth


def _library(*tensors: torch.Tensor):
    """The loaded kernels, for a call on ``tensors``: CPU tensors only (a kernel handed device
    memory would read it as host memory and crash the process)."""
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"ember_kernels.cpu_ops takes CPU tensors; got one on {tensor.device} "
                "(the ember_kernels functions of the same names dispatch by device)"
            )
    library = load_library()
    if library is None:
        raise RuntimeError("ember_kernels.cpu_ops: the compiled CPU kernels are unavailable here")
    if library is not _told[0]:  # first use: the kernels learn the row caps chosen for this CPU
        for dtype in cpu_features.PACKED_GEMV_DTYPES:
            library.set_packed_gemv_max_rows(cpu_features.packed_gemv_max_rows(dtype), dtype)
        library.set_amx_gemm_max_rows(cpu_features.amx_gemm_max_rows())
        _told[0] = library
    return library


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last dim] with a contiguous last dim (a view where the strides allow)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim with float32 statistics (see ``ember_kernels.rms_norm``)."""
    result = _library(x, weight).rms_norm(_rows(x), weight.contiguous(), eps)
    return _shaped(result, x.shape, out)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` as new tensors (inputs unchanged)."""
    normed, total = _library(x, residual, weight).fused_add_rms_norm(
        _rows(x), _rows(residual), weight.contiguous(), eps
    )
    if x.dim() != 2:
        return normed.view(x.shape), total.view(x.shape)
    return normed, total


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x [..., 2*d]``."""
    result = _library(x).silu_and_mul(_rows(x))
    return _shaped(result, (*x.shape[:-1], x.shape[-1] // 2), out)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Per-row argmax (int64 ``[rows]``) of float32 or bfloat16 ``logits [rows, vocab]``: the
    first index of each row's largest value, or of its first NaN, as numpy answers; bfloat16
    widened in registers, rows split between the threads. ValueError for other dtypes."""
    return _library(logits).argmax_rows(_rows(logits))


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotated copies of ``query``/``key [num_tokens, heads, head_size]`` (inputs unchanged)."""
    return _library(positions, query, cos_sin_cache).rotary_embedding(
        positions.to(torch.int64).contiguous(),
        query if query.stride(-1) == 1 else query.contiguous(),
        key if key is None or key.stride(-1) == 1 else key.contiguous(),
        cos_sin_cache.to(query.dtype).contiguous(),
        is_neox_style,
    )


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x (q * scales)^T + bias`` for ``x [rows, in]`` and an int8 ``q [out, in]`` with float32
    ``scales [out]`` or ``[out, groups]`` (see ``ember_kernels.int8_linear``)."""
    return _library(x, q).int8_linear(
        x if x.stride(-1) == 1 else x.contiguous(), q.contiguous(), scales.contiguous(), bias
    )


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x W^T + bias`` on a weight packed by ``ember_kernels.packed_linear.pack_linear_weight``:
    bfloat16 steps of a few rows by a matrix-vector kernel that streams the packed weight, where
    the CPU and oneDNN's layout allow, otherwise oneDNN's matmul (see ``kernels.h``)."""
    out = _library(x).packed_linear(_rows(x), weight, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def packed_gemv_applies(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether ``packed_linear`` runs Ember's decode-step kernel for these operands (a bfloat16
    ``x`` on a CPU with AVX512-BF16 or a float32 one on a CPU with AVX-512, of at most
    ``packed_gemv_max_rows(x.dtype)`` rows, a packed layout the kernel reads:
    ``packed_block_width``)."""
    return _library().packed_gemv_applies(_rows(x), weight, bias)


def packed_gemv_max_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """The most rows of a ``dtype`` step (bfloat16 or float32) ``packed_linear`` runs Ember's
    kernel for, as the compiled kernels hold it (``cpu_features.packed_gemv_max_rows(dtype)``
    unless set)."""
    return _library().packed_gemv_max_rows(dtype)


def set_packed_gemv_max_rows(rows: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """Override the row cap of ``packed_linear``'s kernel for ``dtype`` steps in this process
    (benchmarks and tests; 0 runs oneDNN's matmul for every step); ValueError (from the kernels)
    for a negative ``rows`` or another dtype."""
    _library().set_packed_gemv_max_rows(rows, dtype)


def amx_gemm_applies(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether ``packed_linear`` runs AMX tiles for these operands: a bfloat16 ``x`` of more
    rows than ``packed_gemv_max_rows()`` and at most ``amx_gemm_max_rows()``, a CPU whose tiles
    this process may use, a weight oneDNN packed 32 channels a block, ``in`` a multiple of 32."""
    return _library().amx_gemm_applies(_rows(x), weight, bias)


def amx_gemm_max_rows() -> int:
    """The most rows of a step ``packed_linear`` runs AMX tiles for, as the compiled kernels
    hold it (``cpu_features.amx_gemm_max_rows()`` unless set)."""
    return _library().amx_gemm_max_rows()


def set_amx_gemm_max_rows(rows: int) -> None:
    """Override the AMX tiles' row cap in this process (benchmarks and tests; 0 runs oneDNN's
    matmul above the streaming kernel's cap); ValueError outside [0, 32]."""
    _library().set_amx_gemm_max_rows(rows)


def packed_block_width(weight: torch.Tensor) -> int:
    """The block width (64 or 32) of the layout oneDNN packed a bfloat16 or float32 weight in,
    where Ember's kernel reads it; 0 for any other layout, a plain tensor, or a CPU without the
    kernel's arithmetic for the weight's dtype."""
    return _library().packed_block_width(weight)


def block_width_of(weight: torch.Tensor, stored: torch.Tensor) -> int:
    """The check behind ``packed_block_width`` on plain tensors: the block width (64 or 32) of the
    layout ``stored`` holds the values of ``weight [out, in]`` in (bfloat16, as many elements); 0
    for another layout, or where the values fit several (all equal, say)."""
    return _library(weight, stored).block_width_of(weight.contiguous(), stored.contiguous())


def blocked_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x W^T + bias`` by Ember's streaming kernel on a plain bfloat16 ``weight [out / W, in / 2,
    W, 2]`` (W 64 or 32; ``packed_linear.block_linear_weight`` makes one) for bfloat16 ``x [...,
    in]``, any number of rows: the kernel ``packed_linear`` runs on oneDNN's packed bytes, here on a
    tensor of any engine's making. ValueError naming the argument for other operands;
    RuntimeError on a CPU without AVX512-BF16."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 4 or weight.shape[2] not in (32, 64):
        raise ValueError(
            f"weight: a bfloat16 [out / W, in / 2, W, 2] tensor with W 64 or 32, got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    if weight.shape[3] != 2:
        raise ValueError(f"weight: the last dim holds an input pair (2), got {weight.shape[3]}")
    if x.dtype != torch.bfloat16 or x.dim() < 1 or x.shape[-1] != 2 * weight.shape[1]:
        raise ValueError(
            f"x: bfloat16 [..., {2 * weight.shape[1]}] rows, got {x.dtype} {tuple(x.shape)}"
        )
    out_features = weight.shape[0] * weight.shape[2]
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (out_features,)):
        raise ValueError(f"bias: bfloat16 [{out_features}], got {bias.dtype} {tuple(bias.shape)}")
    rows = _rows(x)
    if rows.stride(0) % 2 or rows.data_ptr() % 4:  # rows read as 32-bit input pairs
        rows = rows.clone(memory_format=torch.contiguous_format)
    out = _library(x, weight, *([] if bias is None else [bias])).blocked_linear(
        rows, weight.contiguous(), None if bias is None else bias.contiguous()
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor, scale: float, out: torch.Tensor
) -> torch.Tensor:
    """Row-by-row ``ember_kernels.lora.lora_shrink`` (x, lora_a and out of one dtype; slot
    indices as a tensor)."""
    _library(x, lora_a).lora_shrink(_rows(x), lora_a.contiguous(), slots.long(), scale, out)
    return out


def lora_expand(
    y: torch.Tensor,
    h: torch.Tensor,
    lora_b: torch.Tensor,
    slots: torch.Tensor,
    y_offset: int,
    h_offset: int,
) -> torch.Tensor:
    """Row-by-row ``ember_kernels.lora.lora_expand`` in place (y, h and lora_b of one dtype;
    rows of ``y`` contiguous). ``lora_b`` may be the transpose of a contiguous ``[slots, rank,
    out]`` tensor, the layout this kernel reads fastest."""
    if y.stride(-1) != 1:
        raise ValueError("y: rows must be contiguous")
    if not (lora_b.is_contiguous() or lora_b.transpose(1, 2).is_contiguous()):
        lora_b = lora_b.contiguous()
    _library(y, h, lora_b).lora_expand(y, _rows(h), lora_b, slots.long(), y_offset, h_offset)
    return y


def moe_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    local_ids: torch.Tensor,
) -> torch.Tensor:
    """The routed experts' weighted sum for ``hidden [tokens, hidden]`` over stacked weights,
    slot by slot (see ``ember_kernels.moe.cpu_experts``); ``local_ids`` outside ``[0, experts)``
    add nothing."""
    # Conversions only where needed: this runs per layer per decode step, for a few tokens.
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        topk_weights = topk_weights.float().contiguous()
    if local_ids.dtype != torch.int64 or not local_ids.is_contiguous():
        local_ids = local_ids.long().contiguous()
    return _library(hidden, w13, w2).moe_experts(
        _rows(hidden), w13.contiguous(), w2.contiguous(), topk_weights, local_ids
    )


def moe_topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32, ids int64)``, each ``[tokens, top_k]``: the top-k experts of
    ``softmax(logits [tokens, experts])``, best first, renormalized to sum 1 if asked (see
    ``ember_kernels.moe.select_experts``)."""
    return _library(logits).moe_topk_softmax(_rows(logits), top_k, renormalize)


def w8a8_linear(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x [rows, in]`` quantized to int8 per row times an int8 ``q [out, in]`` with float32
    ``scales [out]``, plus ``bias`` (see ``ember_kernels.w8a8_linear``)."""
    return _library(x, q).w8a8_linear(x, q.contiguous(), scales.contiguous(), bias)


def decoder_stack(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    rms_norm_eps: float,
    scale: float,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool,
):
    """An empty stack of pre-norm decoder layers run in one call (Llama, Mistral, Qwen2, Qwen3
    shapes; see ``kernels.h``). Give it each layer with ``add_layer(input_norm, qkv, qkv_bias,
    q_norm, k_norm, o_proj, o_bias, post_norm, gate_up, gate_up_bias, down, down_bias, key_cache,
    value_cache, sliding_window)`` (weights as ``[out, in]`` tensors, held, not copied; absent
    biases and norms as None; window 0 for none; int8 weights followed by
    ``set_weight_scales(qkv, o_proj, gate_up, down, quantize_activations)`` with their scales,
    per channel or per group (None for a projection left in floating point), and whether the
    activations are quantized per token: W8A8), and
    projections with LoRA slots followed by ``set_lora(projection, lora_a, lora_b_per_slice)``
    (0 qkv, 1 o_proj, 2 gate_up, 3 down; tensors as ``lora_shrink``/``lora_expand`` take them),
    then call ``forward(hidden_states, residual, positions, slot_mapping, block_table,
    query_start_loc, seq_lens, lora_slots=None)`` for ``(hidden_states, residual)`` after every
    layer, with the same numbers as the per-operation functions here (``lora_slots``: each
    token's adapter slot, -1 for none). Runs without the GIL. ``set_timed(True)`` makes forward
    sum each phase's wall-clock seconds over layers and steps (norms, qkv, qk_norm_rope_cache,
    attention, o_proj, gate_up, silu_and_mul, down), read with ``phase_seconds()`` as
    ``[(phase, seconds), ...]``: where a step's time goes besides the weight streaming."""
    return _library().DecoderStack(
        num_heads, num_kv_heads, head_size, rms_norm_eps, scale, cos_sin_cache, is_neox_style
    )


def _shaped(result: torch.Tensor, shape, out: torch.Tensor | None) -> torch.Tensor:
    """A kernel's [rows, last dim] result in ``shape``, or copied into ``out``."""
    if out is not None:
        return out.copy_(result.view(shape))
    return result if result.dim() == len(shape) else result.view(shape)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` rows into the caches at ``slot_mapping`` (negative: skipped)."""
    library = _library(key, value, key_cache, value_cache, slot_mapping)
    if not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("key_cache/value_cache: expected contiguous caches")
    library.reshape_and_cache(
        _token_rows(key),
        _token_rows(value),
        key_cache,
        value_cache,
        slot_mapping.to(torch.int64).contiguous(),
    )


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``x [num_tokens, heads, head_size]`` with each token's heads contiguous."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


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
    """Causal paged attention read in place from the pages (see ``ember_kernels.paged_attention``).

    ``max_query_len`` / ``max_seq_len`` are accepted for signature parity; the kernel reads the
    lengths itself.
    """
    library = _library(query, key_cache, value_cache, block_table, query_start_loc, seq_lens)
    check_paged_attention_args(
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, sliding_window, out
    )
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap: expected None or > 0, got {soft_cap}")
    if out is None:
        out = torch.empty_like(query)
    if query.stride(2) != 1:
        query = query.contiguous()
    library.paged_attention(
        query,
        key_cache.contiguous(),
        value_cache.contiguous(),
        block_table.to(torch.int32),
        query_start_loc.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        scale,
        sliding_window or 0,
        soft_cap or 0.0,
        out,
    )
    return out
