"""What the CPU offers for reduced-precision arithmetic, one place for every choice that rests on it.

oneDNN picks its kernels at run time (AMX where present, else AVX512-BF16, else a conversion to
float32), and the compiled kernels are built per CPU (``cpu_ops.build``); what is decided here is
only whether bfloat16 or float16 arithmetic is native, and so worth choosing: bfloat16 on a CPU
without it converts every operand and runs slower than float32.
"""

from __future__ import annotations

import functools
import pathlib

import torch


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux names them (empty where /proc/cpuinfo is absent)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _torch_says(name: str) -> bool:
    probe = getattr(torch.cpu, name, None)
    return bool(probe()) if probe is not None else False


@functools.cache
def has_amx_bf16() -> bool:
    """AMX tiles with bfloat16 (Sapphire Rapids and later)."""
    return "amx_bf16" in cpu_flags() or _torch_says("_is_amx_tile_supported")


@functools.cache
def has_bf16_arithmetic() -> bool:
    """Native bfloat16 dot products: AMX-BF16 or AVX512-BF16."""
    return (
        has_amx_bf16() or "avx512_bf16" in cpu_flags() or _torch_says("_is_avx512_bf16_supported")
    )


@functools.cache
def has_fp16_arithmetic() -> bool:
    """Native float16 arithmetic: AVX512-FP16 or AMX-FP16."""
    flags = cpu_flags()
    return "avx512_fp16" in flags or "amx_fp16" in flags or _torch_says("_is_amx_fp16_supported")


# The most rows of a bfloat16 step that Ember's streaming kernel (``cpu_ops.packed_linear``) takes
# from oneDNN's matmul. A step of a few rows is bound by reading the weight, where streaming it
# in stored order beats oneDNN; with more rows AVX512-BF16 dot products become bound by
# arithmetic, which AMX tiles do several times faster, so with AMX the kernel keeps only the few
# rows where it measured at least as fast on every 0.5B shape (``benchmarks/bench_packed_gemv.py``
# prints the kernels per row count on the same packed weight and the cap a CPU supports; the
# figures are in the package README).
PACKED_GEMV_MAX_ROWS = 32
PACKED_GEMV_MAX_ROWS_WITH_AMX = 2
# The same for float32 steps, on any CPU with AVX-512 (the kernel's multiply-adds): AMX has no
# float32 tiles, so oneDNN's float32 matmul does the same arithmetic and streaming wins up to a
# decode batch.
PACKED_GEMV_MAX_ROWS_FLOAT32 = 32
PACKED_GEMV_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes of the streaming kernel's steps
# The most rows of a bfloat16 step that AMX tiles take from oneDNN's matmul above the streaming
# kernel's cap (``cpu_ops/amx_gemm.cpp``: the packed weight streamed once into tiles): a decode
# batch. Larger steps (prefill) run oneDNN's matmul, whose AMX kernels reuse each weight tile
# across many rows.
AMX_GEMM_MAX_ROWS = 32


@functools.cache
def packed_gemv_max_rows(dtype: torch.dtype = torch.bfloat16) -> int:
    """The most rows of a bfloat16 or float32 step on a packed weight that Ember's streaming
    kernel runs here (above it oneDNN's matmul): bfloat16 ``PACKED_GEMV_MAX_ROWS``, or
    ``PACKED_GEMV_MAX_ROWS_WITH_AMX`` on a CPU with AMX-BF16; float32
    ``PACKED_GEMV_MAX_ROWS_FLOAT32``."""
    if dtype not in PACKED_GEMV_DTYPES:
        raise ValueError(f"dtype: the streaming kernel runs {PACKED_GEMV_DTYPES}, got {dtype}")
    if dtype == torch.float32:
        return PACKED_GEMV_MAX_ROWS_FLOAT32
    return PACKED_GEMV_MAX_ROWS_WITH_AMX if has_amx_bf16() else PACKED_GEMV_MAX_ROWS


@functools.cache
def amx_gemm_max_rows() -> int:
    """The most rows of a bfloat16 step on a packed weight that Ember's AMX tiles run here:
    ``AMX_GEMM_MAX_ROWS`` on a CPU with AMX-BF16, else 0 (none)."""
    return AMX_GEMM_MAX_ROWS if has_amx_bf16() else 0


def describe() -> str:
    """One line for logs: which reduced-precision arithmetic this CPU has."""
    parts = [
        "AMX-BF16" if has_amx_bf16() else None,
        "AVX512-BF16" if "avx512_bf16" in cpu_flags() else None,
        "FP16" if has_fp16_arithmetic() else None,
    ]
    found = [p for p in parts if p]
    return ", ".join(found) if found else "no native bfloat16/float16 arithmetic"
