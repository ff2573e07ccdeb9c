"""Random inputs for the kernel tests: fresh each run, with the seed in every failure message."""

from __future__ import annotations

import functools
import math
import random
import types
from dataclasses import dataclass

import pytest
import torch

from ember_kernels import cpu_ops, triton_ops

# The compiled CPU kernels as a test backend (built once per CPU and cached; skipped without a
# compiler, where the torch path serves).
COMPILED = pytest.param(
    cpu_ops,
    id="compiled",
    marks=pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler here"),
)

# Where the Triton kernels run: compiled on a GPU when there is one, else the interpreter on CPU.
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class OnDevice:
    """A kernel module whose functions take CPU tensors and run on ``device``: each tensor argument
    is copied there, the call made, every argument copied back into its CPU tensor (kernels write
    ``out=`` and caches in place), and results that are an argument's copy returned as that
    argument (``result is out`` holds), others moved to the CPU."""

    def __init__(self, module, device: torch.device) -> None:
        self._module, self._device = module, device

    def __getattr__(self, name):
        fn = getattr(self._module, name)
        if isinstance(fn, types.ModuleType):  # TRITON.lora.lora_shrink: wrap the submodule too
            return OnDevice(fn, self._device)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

            def to_device(value):
                if not isinstance(value, torch.Tensor):
                    return value
                copy = value.to(self._device)
                moved[id(copy)] = (value, copy)
                return copy

            result = fn(*map(to_device, args), **{k: to_device(v) for k, v in kwargs.items()})
            for original, copy in moved.values():
                original.copy_(copy)

            def back(value):
                if isinstance(value, tuple):
                    return tuple(back(v) for v in value)
                if isinstance(value, torch.Tensor):
                    return moved[id(value)][0] if id(value) in moved else value.cpu()
                return value

            return back(result)

        return call


# The Triton backend as the tests call it: with CPU tensors, on ``TRITON_DEVICE``.
TRITON = triton_ops if TRITON_DEVICE.type == "cpu" else OnDevice(triton_ops, TRITON_DEVICE)

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    # Within the rounding of the dtype: two units of its machine epsilon.
    torch.float16: dict(rtol=2 * 2**-10, atol=2 * 2**-10),
    torch.bfloat16: dict(rtol=2 * 2**-7, atol=2 * 2**-7),
}


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = random.SystemRandom().randrange(2**63)
    return torch.Generator().manual_seed(seed), seed


@dataclass
class PagedBatch:
    """A batch of sequences with their new tokens' queries and a shuffled, paged KV cache."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.query_start_loc,
            self.seq_lens,
        )

    def as_float64(self) -> tuple[torch.Tensor, ...]:
        return tuple(t.double() if t.is_floating_point() else t for t in self.args)


def make_paged_batch(
    q_and_seq_lens: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Sequences ``(q_len, seq_len)``; their pages are scattered over a shuffled pool.

    Cache slots that belong to no sequence (and the tail of each last page) hold NaN, and block
    table entries past a sequence's pages hold an out-of-range id, so a kernel that reads past a
    sequence's length produces NaN or fails.
    """
    pages = [math.ceil(seq_len / block_size) for _, seq_len in q_and_seq_lens]
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    max_pages = max(max(pages), 1) + 1
    block_table = torch.full((len(pages), max_pages), num_blocks + 7, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    used = 0
    for seq, ((_, seq_len), n) in enumerate(zip(q_and_seq_lens, pages)):
        blocks = order[used : used + n]
        used += n
        block_table[seq, :n] = blocks
        positions = torch.arange(seq_len)
        written[blocks[positions // block_size] * block_size + positions % block_size] = True
    unwritten = ~written.view(num_blocks, block_size)
    key_cache[unwritten] = float("nan")
    value_cache[unwritten] = float("nan")
    q_lens = torch.tensor([q for q, _ in q_and_seq_lens], dtype=torch.int32)
    query_start_loc = torch.zeros(len(pages) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_kv_heads * group, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor([s for _, s in q_and_seq_lens], dtype=torch.int32)
    return PagedBatch(query, key_cache, value_cache, block_table, query_start_loc, seq_lens)


def random_paged_batch(
    q_and_seq_lens: list[tuple[int, int]],
    *,
    num_kv_heads: int = 2,
    group: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
) -> tuple[PagedBatch, int]:
    """``make_paged_batch`` from a fresh generator (small float32 defaults), with its seed."""
    gen, seed = fresh_generator()
    batch = make_paged_batch(
        q_and_seq_lens,
        num_kv_heads=num_kv_heads,
        group=group,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        gen=gen,
        spare_blocks=spare_blocks,
    )
    return batch, seed
