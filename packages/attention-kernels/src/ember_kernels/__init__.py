"""Triton paged attention and fused LLM kernels with torch reference paths."""

__version__ = "0.1.0"
