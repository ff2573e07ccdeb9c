"""RMSNorm, fused add + RMSNorm, SiLU-and-mul and reshape-and-cache against float64 references."""

from __future__ import annotations

import pytest
import torch
from ek_inputs import COMPILED, TOLERANCES, TRITON, fresh_generator

import ember_kernels as ek
from ember_kernels import cpu_ops, torch_ops
from ember_kernels.cpu_ops import build
from ember_kernels.reference import (
    reshape_and_cache_reference,
    rms_norm_reference,
    silu_and_mul_reference,
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BACKENDS = [
    pytest.param(torch_ops, id="torch"),
    pytest.param(TRITON, id="triton"),
    COMPILED,
]


def assert_matches(actual, expected, dtype, seed):
    assert not actual.isnan().any(), f"seed {seed}: unwritten or NaN output"
    torch.testing.assert_close(
        actual.double(), expected, **TOLERANCES[dtype], msg=lambda m: f"seed {seed}: {m}"
    )


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float64 value of ``t`` after rounding to ``dtype`` (what the kernel actually sees)."""
    return t.to(dtype).double()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 80, 1000])
def test_rms_norm(backend, dtype, hidden):
    gen, seed = fresh_generator()
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    out = torch.full_like(x, float("nan"))
    assert backend.rms_norm(x, weight, 1e-6, out=out) is out
    expected = rms_norm_reference(x.double(), weight.double(), 1e-6)
    assert_matches(out, expected, dtype, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm(backend, dtype):
    gen, seed = fresh_generator()
    x = torch.randn(5, 3, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 3, 96, generator=gen).to(dtype)
    before = (x.clone(), residual.clone())
    weight = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    normed, new_residual = backend.fused_add_rms_norm(x, residual, weight, 1e-5)
    total = rounded(x.double() + residual.double(), dtype)
    assert_matches(new_residual, total, dtype, seed)
    assert_matches(normed, rms_norm_reference(total, weight.double(), 1e-5), dtype, seed)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@pytest.mark.parametrize("backend", [COMPILED])
def test_bf16_silu_and_mul_over_the_whole_range(backend):
    """Gates from where the exponential underflows to where it is 1, with and without a tail of
    fewer than 16 columns (bfloat16 rows take their own vectorized path)."""
    gates = torch.tensor([-200.0, -95.0, -87.5, -30.0, -1.0, -1e-3, 0.0, 1e-30, 0.5, 30.0, 300.0])
    gate = torch.cat([gates, torch.linspace(-12, 12, 29)])  # 40 columns: two vectors and 8
    for width in (gate.numel(), 32):
        g = gate[:width]
        x = torch.cat([g, torch.linspace(-3, 3, width)]).view(1, -1).to(torch.bfloat16)
        out = backend.silu_and_mul(x)
        assert_matches(out, silu_and_mul_reference(x.double()), torch.bfloat16, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(backend, dtype):
    gen, seed = fresh_generator()
    x = (torch.randn(4, 6, 2 * 176, generator=gen) * 2).to(dtype)
    out = torch.full((4, 6, 176), float("nan"), dtype=dtype)
    assert backend.silu_and_mul(x, out=out) is out
    assert_matches(out, silu_and_mul_reference(x.double()), dtype, seed)
    assert_matches(backend.silu_and_mul(x), silu_and_mul_reference(x.double()), dtype, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache_writes_only_mapped_slots(backend, dtype, block_size):
    gen, seed = fresh_generator()
    num_blocks, num_kv_heads, head_size, num_tokens = 6, 2, 80, 40
    key = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:5]] = -1  # padding tokens
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    reshape_and_cache_reference(key, value, expected_keys, expected_values, slots)
    backend.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_keys), f"seed {seed}"
    assert torch.equal(value_cache, expected_values), f"seed {seed}"


def test_reshape_and_cache_rejects_mismatched_shapes():
    key = torch.zeros(3, 2, 64)
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        ek.reshape_and_cache(key, key, cache, cache, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="key_cache"):
        ek.reshape_and_cache(key, key, cache[..., :32], cache[..., :32], torch.zeros(3).long())
    with pytest.raises(ValueError, match="key_cache"):
        ek.reshape_and_cache(key, key, cache.half(), cache.half(), torch.zeros(3).long())
    before = cache.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        ek.reshape_and_cache(key, key, cache, cache, torch.tensor([0, 4 * 16, -1]))
    assert torch.equal(cache, before)


def test_norm_and_activation_reject_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        ek.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ek.fused_add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match=r"^x: "):
        ek.silu_and_mul(torch.zeros(2, 7))


def test_without_a_compiler_the_fused_ops_run_the_torch_path(monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(build, "_state", {})
    gen, seed = fresh_generator()
    x = torch.randn(6, 64, generator=gen)
    residual = torch.randn(6, 64, generator=gen)
    weight = torch.rand(64, generator=gen) + 0.5
    assert not cpu_ops.available()
    assert torch.equal(ek.rms_norm(x, weight, 1e-6), torch_ops.rms_norm(x, weight, 1e-6))
    for got, want in zip(
        ek.fused_add_rms_norm(x, residual, weight, 1e-6),
        torch_ops.fused_add_rms_norm(x, residual, weight, 1e-6),
    ):
        assert torch.equal(got, want), f"seed {seed}"
    assert torch.equal(ek.silu_and_mul(x), torch_ops.silu_and_mul(x))
    with pytest.raises(RuntimeError, match="unavailable"):
        cpu_ops.rms_norm(x, weight, 1e-6)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")
def test_compiled_rotary_rejects_positions_outside_the_cache():
    rope = ek.RotaryEmbedding(64, 64, 16, 10000.0)
    query = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="positions: position 16 of token 1"):
        cpu_ops.rotary_embedding(torch.tensor([3, 16]), query, None, rope.cos_sin_cache, True)


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here")
def test_compiled_ops_split_over_threads_match_the_float64_references():
    """Inputs past the one-thread threshold (32K elements), on two threads."""
    gen, seed = fresh_generator()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(300, 512, generator=gen)
        residual = torch.randn(300, 512, generator=gen)
        weight = torch.rand(512, generator=gen) + 0.5
        expected = rms_norm_reference(x.double(), weight.double(), 1e-6)
        assert_matches(cpu_ops.rms_norm(x, weight, 1e-6), expected, torch.float32, seed)
        normed, total = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        assert_matches(total, x.double() + residual.double(), torch.float32, seed)
        assert_matches(normed, rms_norm_reference(total.double(), weight.double(), 1e-6),
                       torch.float32, seed)  # fmt: skip
        assert_matches(cpu_ops.silu_and_mul(x), silu_and_mul_reference(x.double()), torch.float32,
                       seed)  # fmt: skip
        key = torch.randn(300, 2, 64, generator=gen)
        value = torch.randn(300, 2, 64, generator=gen)
        slots = torch.randperm(40 * 16, generator=gen)[:300]
        caches = [torch.zeros(40, 16, 2, 64) for _ in range(4)]
        reshape_and_cache_reference(key, value, caches[0], caches[1], slots)
        cpu_ops.reshape_and_cache(key, value, caches[2], caches[3], slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
        rope = ek.RotaryEmbedding(64, 64, 4096, 10000.0)
        positions = torch.randint(0, 4096, (300,), generator=gen)
        query = torch.randn(300, 4, 64, generator=gen)
        args = (positions, query, key, rope.cos_sin_cache, True)
        for got, want in zip(cpu_ops.rotary_embedding(*args), torch_ops.rotary_embedding(*args)):
            assert torch.equal(got, want), f"seed {seed}"  # fp32: bit for bit
    finally:
        torch.set_num_threads(threads)
