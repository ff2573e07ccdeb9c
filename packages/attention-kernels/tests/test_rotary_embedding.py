"""Rotary embedding: frequencies per rope type, both styles, against float64 and transformers."""

from __future__ import annotations

import pytest
import torch
from ek_inputs import COMPILED, TRITON, fresh_generator

import ember_kernels as ek
from ember_kernels import torch_ops
from ember_kernels.reference import rope_inv_freq_reference, rotary_embedding_reference

LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
SCALINGS = {"none": None, "linear": dict(type="linear", factor=4.0), "llama3": LLAMA3}
BACKENDS = [
    pytest.param(torch_ops, id="torch"),
    pytest.param(TRITON, id="triton"),
    COMPILED,
]
MAX_POSITION = 2048


def angle_tolerance(dtype: torch.dtype) -> dict:
    # The cache holds cos/sin of float32 angles (as transformers does), each off by up to half an
    # ulp of position * inv_freq, so the error grows with the position.
    eps = {torch.float32: 2**-24, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype]
    tol = 8 * max(MAX_POSITION * 2**-24, eps)
    return dict(rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
@pytest.mark.parametrize("is_neox_style", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rotary_matches_float64_reference(backend, scaling, is_neox_style, dtype):
    gen, seed = fresh_generator()
    head_size, rotary_dim = 96, 64  # partial rotary: the last 32 dims pass through
    rope = ek.RotaryEmbedding(
        head_size, rotary_dim, MAX_POSITION, 10000.0, is_neox_style, scaling, dtype=dtype
    )
    positions = torch.randint(0, MAX_POSITION, (9,), generator=gen)
    query = torch.randn(9, 4, head_size, generator=gen).to(dtype)
    key = torch.randn(9, 2, head_size, generator=gen).to(dtype)
    q, k = backend.rotary_embedding(positions, query, key, rope.cos_sin_cache, is_neox_style)
    inv_freq = rope_inv_freq_reference(rotary_dim, 10000.0, scaling)
    for actual, x in ((q, query), (k, key)):
        expected = rotary_embedding_reference(positions, x.double(), inv_freq, is_neox_style)
        torch.testing.assert_close(
            actual.double(), expected, **angle_tolerance(dtype), msg=lambda m: f"seed {seed}: {m}"
        )
        assert torch.equal(actual[..., rotary_dim:], x[..., rotary_dim:])


def test_module_call_keeps_flattened_shape_and_accepts_no_key():
    rope = ek.RotaryEmbedding(64, 64, 128, 10000.0)
    positions = torch.arange(5)
    query = torch.randn(5, 3 * 64)
    q, k = rope(positions, query)
    assert k is None and q.shape == query.shape
    q3, _ = rope(positions, query.view(5, 3, 64))
    assert torch.equal(q, q3.view(5, -1))


@pytest.mark.parametrize("scaling", SCALINGS.values(), ids=SCALINGS.keys())
def test_bit_identical_to_transformers_llama_in_float32(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as modeling

    gen, seed = fresh_generator()
    config = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION,
        rope_theta=500000.0,
        rope_scaling=scaling,
    )
    hf_rope = modeling.LlamaRotaryEmbedding(config)
    positions = torch.randint(0, MAX_POSITION, (11,), generator=gen)
    query = torch.randn(11, 4, 64, generator=gen)
    key = torch.randn(11, 2, 64, generator=gen)
    cos, sin = hf_rope(query, positions[None])
    hf_q, hf_k = modeling.apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    rope = ek.RotaryEmbedding(64, 64, MAX_POSITION, 500000.0, True, scaling)
    q, k = rope(positions, query, key)
    assert torch.equal(q, hf_q[0].transpose(0, 1)), f"seed {seed}"
    assert torch.equal(k, hf_k[0].transpose(0, 1)), f"seed {seed}"


YARNS = {
    "factor": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512),
    "deepseek": dict(
        rope_type="yarn", factor=40.0, original_max_position_embeddings=64, beta_fast=32,
        beta_slow=1, mscale=1.0, mscale_all_dim=0.707,
    ),
    "no-truncate": dict(
        rope_type="yarn", factor=8.0, original_max_position_embeddings=128, truncate=False,
        beta_fast=16,
    ),
}  # fmt: skip


@pytest.mark.parametrize("scaling", YARNS.values(), ids=YARNS.keys())
def test_yarn_is_bit_identical_to_transformers_in_float32(scaling):
    """YaRN's blended frequencies and the attention factor on cos/sin, as transformers'."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as modeling

    gen, seed = fresh_generator()
    config = LlamaConfig(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=MAX_POSITION, rope_parameters={"rope_theta": 10000.0, **scaling},
    )  # fmt: skip
    hf_rope = modeling.LlamaRotaryEmbedding(config)
    positions = torch.randint(0, MAX_POSITION, (11,), generator=gen)
    query, key = torch.randn(11, 4, 64, generator=gen), torch.randn(11, 2, 64, generator=gen)
    cos, sin = hf_rope(query, positions[None])
    hf_q, hf_k = modeling.apply_rotary_pos_emb(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    rope = ek.RotaryEmbedding(64, 64, MAX_POSITION, 10000.0, True, scaling)
    q, k = rope(positions, query, key)
    assert torch.equal(q, hf_q[0].transpose(0, 1)), f"seed {seed}"
    assert torch.equal(k, hf_k[0].transpose(0, 1)), f"seed {seed}"


def test_rejects_unsupported_or_incomplete_scaling():
    with pytest.raises(ValueError, match="rope_scaling"):
        ek.RotaryEmbedding(64, 64, 128, 10000.0, rope_scaling={"rope_type": "yarn", "factor": 2})
    with pytest.raises(ValueError, match="rope_scaling"):
        ek.RotaryEmbedding(64, 64, 128, 10000.0, rope_scaling={"rope_type": "dynamic"})
    with pytest.raises(ValueError, match="rope_scaling"):
        ek.RotaryEmbedding(64, 64, 128, 10000.0, rope_scaling={"rope_type": "llama3"})
    with pytest.raises(ValueError, match="rotary_dim"):
        ek.RotaryEmbedding(64, 65, 128, 10000.0)
    rope = ek.RotaryEmbedding(64, 64, 128, 10000.0)
    with pytest.raises(ValueError, match="positions"):
        rope(torch.arange(3), torch.zeros(4, 2, 64))
    with pytest.raises(ValueError, match="query"):
        rope(torch.arange(4), torch.zeros(4, 2, 32))
