"""Linear layers on oneDNN-packed weights against torch's own linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ek_inputs import fresh_generator

from ember_kernels import cpu_ops
from ember_kernels.cpu_features import cpu_flags, has_amx_bf16, has_bf16_arithmetic
from ember_kernels.packed_linear import (
    MIN_PACKED_ELEMENTS,
    can_pack_linear_weight,
    linear,
    pack_linear_weight,
    packing_pays,
)

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 160), (256, 8192), (160, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(tokens, in_features, out_features, bias):
    gen, seed = fresh_generator()
    weight = torch.randn(in_features, out_features, generator=gen).t()  # input-major, as kept
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(tokens, in_features, generator=gen)
    packed = pack_linear_weight(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    got = linear(x, packed, b)
    assert got.dtype == torch.float32 and got.shape == (tokens, out_features)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4, msg=f"seed {seed}")
    assert torch.equal(linear(x, weight, b), F.linear(x, weight, b))  # plain weights: torch's
    view = torch.randn(tokens, 2 * in_features, generator=gen)[:, :in_features]
    assert torch.equal(linear(view, packed, b), linear(view.contiguous(), packed, b))


def test_only_cpu_matrices_of_the_packable_dtypes_are_packed():
    weight = torch.randn(8, 4)
    assert can_pack_linear_weight(weight)
    assert can_pack_linear_weight(weight.bfloat16()) == has_bf16_arithmetic()
    for other in (weight.half(), weight[0], pack_linear_weight(weight)):
        assert not can_pack_linear_weight(other)
    with pytest.raises(ValueError, match=r"weight: cannot pack a torch\.float16 \(8, 4\)"):
        pack_linear_weight(weight.half())


def test_packing_pays_for_packable_weights_from_their_dtypes_size_up():
    smallest = MIN_PACKED_ELEMENTS[torch.float32]
    assert packing_pays(torch.empty(smallest // 64, 64))
    assert not packing_pays(torch.empty(smallest // 64 - 1, 64))
    assert not packing_pays(torch.empty(smallest // 64, 64, dtype=torch.float16))
    assert packing_pays(torch.empty(8, 8, dtype=torch.bfloat16)) == has_bf16_arithmetic()


@pytest.mark.skipif(not has_bf16_arithmetic(), reason="no bfloat16 dot products on this CPU")
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_packed_bfloat16_linear_matches_torch(tokens):
    gen, seed = fresh_generator()
    weight = torch.randn(256, 160, generator=gen).bfloat16().t()
    b = torch.randn(160, generator=gen).bfloat16()
    x = torch.randn(tokens, 256, generator=gen).bfloat16()
    got = linear(x, pack_linear_weight(weight), b)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, 160)
    expected = F.linear(x.double(), weight.double(), b.double())
    # float32 accumulation, one bfloat16 rounding of the result
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=5e-2, msg=f"seed {seed}")


@pytest.mark.skipif(
    not (has_bf16_arithmetic() and cpu_ops.available()), reason="no bfloat16 dot products here"
)
@pytest.mark.parametrize("out_features", [64, 320, 640, 1152])
def test_one_row_equals_the_same_row_in_a_pair(out_features):
    """One row streams four blocks of channels at a time (with prefetch), two rows two: each
    block's sums run in the same order either way, so a row gives the same bits alone or
    beside another (block counts with and without a remainder of four, per thread)."""
    if not cpu_ops.packed_gemv_applies(
        torch.zeros(1, 96, dtype=torch.bfloat16),
        pack_linear_weight(torch.zeros(64, 96, dtype=torch.bfloat16)),
        None,
    ):
        pytest.skip("no matrix-vector kernel on this CPU")
    gen, seed = fresh_generator()
    weight = torch.randn(out_features, 896, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16()
    x = torch.randn(1, 896, generator=gen).bfloat16()
    packed = pack_linear_weight(weight)
    alone = cpu_ops.packed_linear(x, packed, b)
    paired = cpu_ops.packed_linear(torch.cat([x, -x]), packed, b)
    assert torch.equal(alone[0], paired[0]), f"seed {seed}"
    expected = F.linear(x.double(), weight.double(), b.double())
    torch.testing.assert_close(alone.double(), expected, rtol=1e-2, atol=5e-2, msg=f"seed {seed}")


@pytest.mark.skipif(
    not (has_bf16_arithmetic() and cpu_ops.available()), reason="no bfloat16 dot products here"
)
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 13, 32, 33])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 320), (4864, 128), (64, 160)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bfloat16_rows_of_a_decode_step(tokens, in_features, out_features, bias):
    """Up to a decode batch of bfloat16 rows on a packed weight: float32 sums rounded once,
    whichever path runs; Ember's kernel runs for up to this CPU's cap of rows (32, or 4 with
    AMX; above 4 in tiles of 6 rows, a ragged last tile included) where the CPU has AVX512-BF16
    and the output channels fill oneDNN's blocks (64 wide, 32 with AMX), and the per-operation
    path and the compiled stack call the same function."""
    gen, seed = fresh_generator()
    weight = torch.randn(in_features, out_features, generator=gen).bfloat16().t()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(tokens, in_features, generator=gen).bfloat16()
    packed = pack_linear_weight(weight)
    got = linear(x, packed, b)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, out_features)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=5e-2, msg=f"seed {seed}")
    assert torch.equal(got, cpu_ops.packed_linear(x, packed, b))
    width = 32 if has_amx_bf16() else 64  # oneDNN's block width with AMX tiles, and without
    runs_kernel = (
        tokens <= cpu_ops.packed_gemv_max_rows()
        and out_features % width == 0
        and "avx512_bf16" in cpu_flags()
    )
    assert cpu_ops.packed_gemv_applies(x, packed, b) == runs_kernel
    view = torch.randn(tokens, 2 * in_features, generator=gen).bfloat16()[:, :in_features]
    assert torch.equal(linear(view, packed, b), linear(view.contiguous(), packed, b))
    # rows read as 32-bit pairs: a view starting mid-pair runs oneDNN
    odd = torch.randn(tokens, in_features + 1, generator=gen).bfloat16()[:, 1:]
    assert not cpu_ops.packed_gemv_applies(odd, packed, b)
    got_odd, got_copy = (
        linear(odd, packed, b).double(),
        linear(odd.contiguous(), packed, b).double(),
    )
    torch.testing.assert_close(got_odd, got_copy, rtol=1e-2, atol=5e-2, msg=f"seed {seed}")


@pytest.mark.skipif(not cpu_ops.available(), reason="no compiled kernels here")
def test_decode_batch_groups_are_each_written_once_whichever_thread_takes_them():
    """Above 4 rows each thread takes the front of its share of 64-channel groups, and one that
    is done takes groups from the back of another's: with more threads than cores (threads the
    OS deschedules mid-matmul, whose groups others take) every output equals the one-thread
    result, bit for bit, call after call."""
    gen, seed = fresh_generator()
    dtype = torch.bfloat16 if has_bf16_arithmetic() else torch.float32
    weight = torch.randn(9728, 896, generator=gen).to(dtype)
    x = torch.randn(32, 896, generator=gen).to(dtype)
    packed = pack_linear_weight(weight)
    if not cpu_ops.packed_gemv_applies(x, packed, None):
        pytest.skip("no streaming kernel for this dtype on this CPU")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_ops.packed_linear(x, packed, None)
        torch.set_num_threads(3 * max(2, threads))
        for _ in range(20):
            assert torch.equal(cpu_ops.packed_linear(x, packed, None), alone), f"seed {seed}"
    finally:
        torch.set_num_threads(threads)
