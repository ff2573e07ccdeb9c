"""Rotary position embedding module: inverse frequencies per rope-scaling type, cos/sin cache."""

from __future__ import annotations

import math

import torch

from ember_kernels import ops
from ember_kernels.yarn import yarn_parameters

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The keys each rope type needs in a Hugging Face rope-parameters dict (others are ignored).
_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"original_max_position_embeddings"},
}


class RotaryEmbedding(torch.nn.Module):
    """Rotary embedding for ``query``/``key [num_tokens, heads, head_size]`` from positions.

    ``is_neox_style`` rotates the halves ``(x[:d/2], x[d/2:d])`` (NeoX, Llama); otherwise adjacent
    pairs ``(x[0::2], x[1::2])`` (GPT-J). Only the first ``rotary_dim`` dims of each head rotate.
    ``rope_scaling`` is a Hugging Face rope dict (``rope_type`` or legacy ``type``): "default",
    "linear", "llama3" or "yarn" (whose attention factor scales cos and sin). Frequencies and the
    cos/sin cache are computed in float32 exactly as Hugging Face transformers computes them, then
    stored in ``dtype``.
    """

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        rope_scaling: dict | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
            raise ValueError(
                f"rotary_dim: expected an even value in (0, {head_size}], got {rotary_dim}"
            )
        if max_position < 1:
            raise ValueError(f"max_position: expected >= 1, got {max_position}")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.is_neox_style = is_neox_style
        scaling = dict(rope_scaling or {})
        if scaling.get("rope_type", scaling.get("type")) == "yarn":
            _check_keys("yarn", scaling)
            inv_freq, factor = yarn_parameters(rotary_dim, base, scaling, max_position)
        else:
            inv_freq, factor = compute_inv_freq(rotary_dim, base, rope_scaling), 1.0
        # position * inv_freq as one float32 product, as transformers' rotary embedding does.
        angles = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        cache = torch.cat([cos, sin], dim=-1).to(dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return rotated copies of ``query`` and ``key`` (which may be None).

        ``query``/``key`` may also be flattened ``[num_tokens, heads * head_size]``; the result
        keeps the input's shape.
        """
        if positions.dim() != 1 or positions.shape[0] != query.shape[0]:
            raise ValueError(
                f"positions: expected [num_tokens={query.shape[0]}], got {tuple(positions.shape)}"
            )
        q = self._heads(query, "query")
        k = None if key is None else self._heads(key, "key")
        cache = self.cos_sin_cache
        if cache.device != query.device:
            cache = self.cos_sin_cache = cache.to(query.device)
        q_out, k_out = ops.rotary_embedding(positions, q, k, cache, self.is_neox_style)
        return q_out.view(query.shape), None if key is None else k_out.view(key.shape)

    def _heads(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if x.dim() == 2 and x.shape[1] % self.head_size == 0:
            return x.view(x.shape[0], -1, self.head_size)
        if x.dim() == 3 and x.shape[2] == self.head_size:
            return x
        raise ValueError(
            f"{name}: expected [num_tokens, heads, {self.head_size}] or its flattened form, "
            f"got {tuple(x.shape)}"
        )

    def extra_repr(self) -> str:
        return (
            f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
            f"max_position={self.max_position}, is_neox_style={self.is_neox_style}"
        )


def compute_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """Float32 inverse frequencies ``[rotary_dim // 2]``, with the same float32 operations as
    transformers' rope initialisers, so that cos/sin match it bit for bit."""
    scaling = dict(rope_scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    _check_keys(rope_type, scaling)
    if rope_type == "yarn":
        return yarn_parameters(
            rotary_dim, base, scaling, scaling["original_max_position_embeddings"]
        )[0]
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "default":
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _check_keys(rope_type: str, scaling: dict) -> None:
    missing = _KEYS[rope_type] - scaling.keys()
    if missing:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} needs {sorted(missing)}")
