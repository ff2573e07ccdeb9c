"""Paged attention against the float64 reference, on fresh random batches each run."""

from __future__ import annotations

import importlib
import itertools

import pytest
import torch
from ek_inputs import COMPILED, TOLERANCES, TRITON, random_paged_batch

import ember_kernels as ek
from ember_kernels import cpu_ops, torch_ops
from ember_kernels.cpu_ops import build
from ember_kernels.reference import paged_attention_reference

HEAD_SIZES = (64, 80, 96, 128, 256)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def mixed_lengths(block_size: int, long: int) -> list[tuple[int, int]]:
    """(q_len, seq_len) pairs: decodes at the page edges and a long one, full and chunked prefills."""
    b = block_size
    return [
        (1, 1),
        (1, b - 1),
        (1, b),
        (1, b + 1),
        (1, long),
        (b - 1, b - 1),
        (b, b),
        (b + 1, b + 1),
        (7, long),  # a chunk of a prefill whose earlier tokens are cached
        (b + 3, 2 * b + 5),
    ]


def check(
    backend, lengths, *, group, head_size, block_size, dtype, window=None, soft_cap=None, **kwargs
):
    batch, seed = random_paged_batch(
        lengths, group=group, head_size=head_size, block_size=block_size, dtype=dtype
    )
    scale = head_size**-0.5
    out = torch.full_like(batch.query, float("nan"))
    result = backend.paged_attention(
        *batch.args, scale=scale, sliding_window=window, soft_cap=soft_cap, out=out, **kwargs
    )
    assert result is out
    expected = paged_attention_reference(
        *batch.as_float64(), scale=scale, sliding_window=window, soft_cap=soft_cap
    )
    assert not out.isnan().any(), f"seed {seed}: unwritten or NaN output"
    torch.testing.assert_close(
        out.double(), expected, **TOLERANCES[dtype], msg=lambda m: f"seed {seed}: {m}"
    )


WINDOW_AND_CAP = ((None, None), (37, None), (None, 30.0), (37, 30.0))


# The two CPU paths: vectorized torch, and the compiled kernel.
CPU_BACKENDS = [pytest.param(torch_ops, id="torch"), COMPILED]


# Every head size, block size and dtype; each runs two GQA ratios (alternating so that every
# head size meets all four) with rotating window/soft-cap settings. The slow test below runs the
# whole product.
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_path_mixed_batch(backend, head_size, block_size, dtype):
    shift = HEAD_SIZES.index(head_size)
    first = (shift + DTYPES.index(dtype) + BLOCK_SIZES.index(block_size)) % 2
    for k in (first, first + 2):
        window, soft_cap = WINDOW_AND_CAP[(k + shift) % len(WINDOW_AND_CAP)]
        check(
            backend,
            mixed_lengths(block_size, 300),
            group=GROUPS[k],
            head_size=head_size,
            block_size=block_size,
            dtype=dtype,
            window=window,
            soft_cap=soft_cap,
        )


@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_path_mixed_batch_full_sweep(backend, head_size, block_size, dtype):
    for group, (window, soft_cap) in itertools.product(GROUPS, WINDOW_AND_CAP):
        check(
            backend,
            mixed_lengths(block_size, 700),
            group=group,
            head_size=head_size,
            block_size=block_size,
            dtype=dtype,
            window=window,
            soft_cap=soft_cap,
        )


# (head_size, dtype, block_size, group, window, soft_cap): each head size, dtype, block size, GQA
# ratio, window and soft-cap setting at least once under the interpreter (about 1-5 s a case).
TRITON_CASES = [
    (64, torch.float32, 16, 1, None, None),
    (80, torch.bfloat16, 32, 2, 37, 30.0),
    (96, torch.float16, 16, 4, None, 30.0),
    (128, torch.float32, 32, 8, 37, None),
    (256, torch.bfloat16, 16, 2, None, None),
    (128, torch.float16, 32, 1, 37, 30.0),
]


@pytest.mark.parametrize(
    "head_size,dtype,block_size,group,window,soft_cap", TRITON_CASES, ids=lambda v: str(v)
)
def test_triton_kernel_mixed_batch(head_size, dtype, block_size, group, window, soft_cap):
    check(
        TRITON,
        mixed_lengths(block_size, 260),
        group=group,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        window=window,
        soft_cap=soft_cap,
    )


@pytest.mark.parametrize("num_kv_splits,window", [(2, None), (4, 50)])
def test_triton_split_kv_decode(num_kv_splits, window):
    """Forced KV splits, including splits left empty by short sequences or the window."""
    check(
        TRITON,
        [(1, 1), (1, 15), (1, 33), (1, 290), (1, 150)],
        group=4,
        head_size=64,
        block_size=16,
        dtype=torch.float32,
        window=window,
        num_kv_splits=num_kv_splits,
        max_query_len=1,
    )


def test_triton_split_kv_mixed_batch():
    check(
        TRITON,
        mixed_lengths(16, 140),
        group=2,
        head_size=80,
        block_size=16,
        dtype=torch.float16,
        soft_cap=20.0,
        num_kv_splits=2,
    )


@pytest.mark.slow
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_kernel_full_sweep(head_size, block_size, dtype):
    for i, group in enumerate(GROUPS):
        window, soft_cap = WINDOW_AND_CAP[i]
        for splits in (1, 4):
            check(
                TRITON,
                mixed_lengths(block_size, 300),
                group=group,
                head_size=head_size,
                block_size=block_size,
                dtype=dtype,
                window=window,
                soft_cap=soft_cap,
                num_kv_splits=splits,
            )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("lengths", [[(1, 5), (1, 300), (1, 17)], [(40, 40)], [(3, 50), (9, 9)]])
def test_cpu_path_decode_only_and_prefill_only(backend, lengths):
    check(backend, lengths, group=4, head_size=64, block_size=16, dtype=torch.float32)


@pytest.mark.parametrize("backend", [COMPILED])
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("group", [7, 3, 1])
def test_compiled_bf16_decode_key_and_row_tails(backend, group, head_size):
    """bfloat16 decode as a Qwen2.5-0.5B layer runs it (7 query heads per KV head): key counts
    at and beside the kernels' eight-key groups and 64-key chunks, query rows in pairs and fours
    with every remainder, head sizes of one, one and a half and two 64-dim blocks; with a window
    and a soft cap as well."""
    lengths = [(1, n) for n in (1, 7, 8, 9, 63, 64, 65, 129, 200)] + [(2, 21), (3, 70)]
    kwargs = dict(group=group, head_size=head_size, block_size=16, dtype=torch.bfloat16)
    check(backend, lengths, **kwargs)
    check(backend, lengths, **kwargs, window=50, soft_cap=30.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("group,window,soft_cap", [(1, None, None), (4, 70, None), (2, 45, 20.0)])
def test_cpu_path_long_prefill_spans_tiles_and_chunks(backend, group, window, soft_cap):
    """Prefills of several query tiles and key chunks, full and chunked (cached prefix)."""
    check(
        backend,
        [(200, 200), (130, 333), (1, 250)],
        group=group,
        head_size=40,
        block_size=16,
        dtype=torch.float32,
        window=window,
        soft_cap=soft_cap,
    )


def test_sequence_without_new_tokens_is_skipped():
    batch, _ = random_paged_batch([(1, 20), (0, 10), (2, 30)], num_kv_heads=1)
    out = ek.paged_attention(*batch.args, scale=0.125)
    expected = paged_attention_reference(*batch.as_float64(), scale=0.125)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_public_function_dispatches_cpu_tensors_to_a_cpu_path():
    """The compiled kernel where it could be built, else the torch path."""
    batch, _ = random_paged_batch(mixed_lengths(16, 40))
    via_public = ek.paged_attention(*batch.args, scale=0.125, max_query_len=17, max_seq_len=40)
    cpu_path = cpu_ops if cpu_ops.available() else torch_ops
    via_path = cpu_path.paged_attention(*batch.args, scale=0.125)
    torch.testing.assert_close(via_public, via_path, rtol=0, atol=0)


def test_without_a_compiler_the_torch_path_serves_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(build, "_state", {})
    batch, _ = random_paged_batch(mixed_lengths(16, 40))
    with caplog.at_level("WARNING", logger="ember_kernels"):
        out = ek.paged_attention(*batch.args, scale=0.125)
        again = ek.paged_attention(*batch.args, scale=0.125)
    assert not cpu_ops.available()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "using the torch path" in warnings[0], warnings
    expected = torch_ops.paged_attention(*batch.args, scale=0.125)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_ops.paged_attention(*batch.args, scale=0.125)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")
def test_compiled_path_rejects_block_ids_outside_the_cache():
    batch, _ = random_paged_batch([(1, 40), (2, 20)])
    batch.block_table[1, 1] = batch.key_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_table: sequence 1 page 1"):
        cpu_ops.paged_attention(*batch.args, scale=0.125)


def test_bad_arguments_raise_value_error_naming_the_field():
    batch, _ = random_paged_batch([(2, 4)], group=1)
    q, kc, vc, bt, qsl, sl = batch.args
    with pytest.raises(ValueError, match="num_q_heads"):
        ek.paged_attention(q[:, :1].expand(-1, 3, -1), kc, vc, bt, qsl, sl, scale=1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        ek.paged_attention(q, kc, vc, bt, qsl[:1], sl, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        ek.paged_attention(q, kc, vc, bt, qsl, sl - 3, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        ek.paged_attention(q, kc, vc, bt, qsl, sl, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match=r"^out: "):
        ek.paged_attention(q, kc, vc, bt, qsl, sl, scale=1.0, out=q.half())


def test_cpu_plan_is_rebuilt_when_metadata_changes_in_place():
    """Layers of a step reuse one batch plan; rewriting the metadata (here through a numpy
    view, which torch cannot see) must give a fresh plan, never a stale one."""
    batch, seed = random_paged_batch([(1, 40), (3, 21), (1, 17)], spare_blocks=4)
    first = torch_ops.paged_attention(*batch.args, scale=0.125)
    again = torch_ops.paged_attention(*batch.args, scale=0.125)
    assert torch.equal(first, again)
    # Move sequence 0's second page to a spare block, and shorten sequence 2 by one token.
    spare = sorted(set(range(batch.key_cache.shape[0])) - set(batch.block_table.view(-1).tolist()))
    old_block = int(batch.block_table[0, 1])
    batch.key_cache[spare[0]] = batch.key_cache[old_block]
    batch.value_cache[spare[0]] = batch.value_cache[old_block]
    batch.key_cache[old_block] = float("nan")
    batch.value_cache[old_block] = float("nan")
    batch.block_table.numpy()[0, 1] = spare[0]
    batch.seq_lens.numpy()[2] -= 1
    moved = torch_ops.paged_attention(*batch.args, scale=0.125)
    expected = paged_attention_reference(*batch.as_float64(), scale=0.125)
    assert not moved.isnan().any(), f"seed {seed}: a stale plan read the old block"
    torch.testing.assert_close(
        moved.double(), expected, rtol=1e-5, atol=1e-5, msg=lambda m: f"seed {seed}: {m}"
    )


@pytest.mark.parametrize("chunk_bytes", [1, 300_000])
def test_cpu_path_cut_into_chunks_of_sequences(monkeypatch, chunk_bytes):
    """Groups cut into chunks (one sequence each, or two) give the same results."""
    module = importlib.import_module("ember_kernels.torch_ops.paged_attention")
    monkeypatch.setattr(module, "CHUNK_BYTES", chunk_bytes)
    check(
        torch_ops, mixed_lengths(16, 120), group=2, head_size=64, block_size=16, dtype=torch.float32
    )


def test_compiled_kernels_refuse_tensors_off_the_cpu():
    # Device memory read as host memory would crash the process: refused by name instead (a
    # meta tensor stands for a GPU's here; on a GPU machine its tensors take the same branch).
    batch, _ = random_paged_batch([(1, 8)])
    args = [a.to("meta") for a in batch.args]
    with pytest.raises(ValueError, match="CPU tensors; got one on meta"):
        cpu_ops.paged_attention(*args, scale=0.125)
    with pytest.raises(ValueError, match="CPU tensors"):
        cpu_ops.rms_norm(torch.empty(2, 8, device="meta"), torch.empty(8), 1e-6)
